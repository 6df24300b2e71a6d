"""The egress proxy as it was before issue 34, for benchmarks that compare
with it in the same run: Debian's GnuTLS build of squid (the proxy
Dockerfile at f3296f3) with the configuration of then (squid's native
access log and its own mime table; no TLS settings, no rules).

`ensure_image()` builds it (once; a label hashes its inputs).
`python -m bench.proxy_before BROKER-ARGS` runs today's sandbox broker, which
gives the tickets named `before-...` that proxy and every other ticket
today's: the image and the configuration are the only difference, and one
broker process serves both kinds, so a ratio of the two is the cost of
today's proxy. A `before-` ticket with egress rules is refused (the proxy of
before had none).
"""

from __future__ import annotations

import hashlib
import subprocess
import threading
from typing import Any

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.host.images import BASE_IMAGE, IMAGE_DIGEST_LABEL
from services.common.secrecy.childenv import docker_cli_env

IMAGE = "afe/bench-proxy-before:latest"
TICKET_PREFIX = "before-"

# deploy/images/proxy/Dockerfile at f3296f3, but asking for the GnuTLS build by name: a base
# made since holds squid-openssl (build-base.sh), which `command -v squid` took for squid.
DOCKERFILE = """\
ARG BASE=afe/base:bookworm
FROM ${BASE}
USER root
RUN squid -v 2>/dev/null | grep -q -- --with-gnutls || \\
    (apt-get update && apt-get install -y --no-install-recommends squid iproute2 && rm -rf /var/lib/apt/lists/*)
RUN squid -v | grep -q -- --with-gnutls
RUN mkdir -p /var/run/squid /var/spool/squid /var/log/squid && \\
    chown -R proxy:proxy /var/run/squid /var/spool/squid /var/log/squid
USER proxy
CMD ["sh", "-c", "printf '%s' \\"$AFE_SQUID_CONF\\" > /tmp/squid.conf && exec squid -N -f /tmp/squid.conf"]
"""


def _docker(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *argv], input=stdin, capture_output=True, text=True, check=False,
                          env=docker_cli_env())


def ensure_image() -> str:
    """Build the proxy of before unless it is there from today's inputs; returns its name."""
    base = _docker("image", "inspect", "--format", "{{.Id}}", BASE_IMAGE)
    if base.returncode != 0:
        raise FailedPrecondition(f"the base image {BASE_IMAGE} is missing: run `make images` first")
    digest = hashlib.sha256(base.stdout.strip().encode() + b"\0" + DOCKERFILE.encode()).hexdigest()[:32]
    have = _docker("image", "inspect", "--format", f'{{{{index .Config.Labels "{IMAGE_DIGEST_LABEL}"}}}}', IMAGE)
    if have.returncode == 0 and have.stdout.strip() == digest:
        return IMAGE
    r = _docker("build", "--build-arg", f"BASE={BASE_IMAGE}", "--label", f"{IMAGE_DIGEST_LABEL}={digest}",
                "-t", IMAGE, "-", stdin=DOCKERFILE)
    if r.returncode != 0:
        raise FailedPrecondition(f"building {IMAGE} (Debian's squid, the GnuTLS build) failed:\n"
                                 + (r.stdout + r.stderr)[-3000:])
    return IMAGE


def before_conf(conf: str) -> str:
    """Today's configuration of a ticket without rules as it was before: squid's
    native access log, no TLS settings (the GnuTLS build knows neither), squid's own mime table."""
    out = []
    for line in conf.splitlines():
        if line.startswith(("logformat ", "tls_outgoing_options ", "mime_table ")):
            continue
        out.append("access_log stdio:/dev/stdout" if line.startswith("access_log stdio:/dev/stdout") else line)
    return "\n".join(out) + "\n"


_making = threading.local()       # the ticket whose containers this thread makes is a `before-` one


def _patch() -> None:
    from services.sandbox.containers import provision

    today_conf = provision.squid_conf
    today_create = provision.create_containers

    def squid_conf(*args: Any, **kw: Any) -> str:
        conf = today_conf(*args, **kw)
        if not getattr(_making, "before", False):
            return conf
        if kw.get("rules"):
            raise InvalidArgument("the proxy of before issue 34 has no egress rules")
        return before_conf(conf)

    def create_containers(client: Any, s: Any, *args: Any, **kw: Any) -> Any:
        _making.before = s.ticket_id.startswith(TICKET_PREFIX)
        if _making.before:
            kw["proxy_image"] = IMAGE
        try:
            return today_create(client, s, *args, **kw)
        finally:
            _making.before = False
    provision.squid_conf = squid_conf
    provision.create_containers = create_containers


if __name__ == "__main__":
    from services.sandbox import main as broker_main
    _patch()
    broker_main.main()
