"""The proxy side of egress rules (R44): squid terminates TLS for the hosts
that have rules (ssl-bump, docs/adr/0007-egress-rules-squid-ssl-bump.md),
judges each decrypted request with judge.py and re-encrypts to the
upstream, verifying its certificate against the system store and the
operator's `AFE_CA_FILE`. Hosts without rules keep CONNECT pass-through.

What the broker gives the proxy is in `<run>/egress-ca/<ticket>/proxy/`,
mounted read-only at `/run/afe-bump`: the judge's source, the rules, the
upstream CA file (when AFE_CA_FILE is set) and the 403 pages. The proxy's
command starts with `PREPARE`, which makes the ticket's CA in the proxy's
own tmpfs (the key never leaves the container), prints the certificate
between egress_ca.BEGIN/END on stderr for the broker, and initialises
squid's certificate store, then runs the usual command (squid, or the
socket transport's main process).

    sandbox --CONNECT host:443--> squid
        host has rules:   bump (TLS with a certificate for host from the ticket's CA),
                          each request -> judge -> 403 naming the rule, or on to the
                          upstream over TLS verified against the system store + AFE_CA_FILE
        any other host:   peek at the ClientHello, then splice (the bytes pass as they are);
                          a ClientHello naming a host with rules is cut (terminate)
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from services.common.config.egress_rules import EgressRule
from services.common.layout import Layout
from services.sandbox.egress import ca as egress_ca
from services.sandbox.egress import judge as egress_judge

BUMP_MOUNT = "/run/afe-bump"        # in the proxy, read-only
TLS_DIR = "/tmp/afe-tls"           # in the proxy's tmpfs: the CA's key, squid's certificate store
CERTGEN = "/usr/lib/squid/security_file_certgen"
JUDGE = "judge.py"
RULES = "rules.json"
UPSTREAM_CA = "upstream.pem"
ERROR_PAGES = {
    # %o: the message of the external ACL helper (the judge) that refused the request
    "ERR_AFE_EGRESS": "afe egress: %o\n",
    "ERR_AFE_TUNNEL": "afe egress: CONNECT inside a decrypted connection is refused on hosts with egress rules "
                      "(the proxy cannot judge what a nested tunnel carries)\n",
}

# The proxy's first step when the ticket has rules; `exec "$@"` runs its usual command. It
# starts three programs: mkdir, ln and openssl (each costs milliseconds of the proxy's half
# CPU before squid listens; make bench): squid's certificate store is made with the shell as
# `security_file_certgen -c` makes it (a folder certs/, an empty index.txt, a size of 0), the
# error folder links squid's pages and afe's, and the certificate is printed with `read`.
PREPARE = f"""set -eu
umask 077
mkdir -p {TLS_DIR}/db/certs {TLS_DIR}/errors
ln -sf /usr/share/squid/errors/templates/* {" ".join(f"{BUMP_MOUNT}/{name}" for name in ERROR_PAGES)} {TLS_DIR}/errors/
: > {TLS_DIR}/db/index.txt
printf 0 > {TLS_DIR}/db/size
openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -sha256 -days 365 \\
  -subj "/CN=afe egress CA of ticket $AFE_TICKET" -keyout {TLS_DIR}/ca.key -out {TLS_DIR}/ca.pem \\
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
{{ echo {egress_ca.BEGIN}; while IFS= read -r line; do echo "$line"; done < {TLS_DIR}/ca.pem; echo {egress_ca.END}; }} >&2
exec "$@"
"""


def proxy_command(inner: list[str]) -> list[str]:
    return ["sh", "-c", PREPARE, "afe-proxy", *inner]


def proxy_dir(layout: Layout, ticket_id: str) -> Path:
    return egress_ca.ticket_dir(layout, ticket_id) / "proxy"


def clauses(rules: Iterable[EgressRule]) -> dict[str, list[egress_judge.Clause]]:
    out: dict[str, list[egress_judge.Clause]] = {}
    for r in rules:
        out.setdefault(r.host, []).append(egress_judge.Clause(
            name=r.name, methods=r.methods, paths=r.paths, ignore_case=r.ignore_case, summary=r.summary()))
    return out


def make_proxy_dir(layout: Layout, ticket_id: str, rules: Iterable[EgressRule], upstream_ca: bytes) -> str:
    """Write what the proxy reads (root-owned, world-readable: nothing here is secret)."""
    d = proxy_dir(layout, ticket_id)
    d.mkdir(parents=True, exist_ok=True, mode=0o755)
    os.chmod(d.parent, 0o755)
    os.chmod(d, 0o755)
    files = {JUDGE: Path(egress_judge.__file__).read_bytes(),
             RULES: egress_judge.rules_json(clauses(rules)).encode(),
             **{name: text.encode() for name, text in ERROR_PAGES.items()}}
    if upstream_ca:
        files[UPSTREAM_CA] = upstream_ca
    for name, data in files.items():
        tmp = d / f".{name}.tmp"
        tmp.write_bytes(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, d / name)
    return str(d)


def squid_lines(rules: Iterable[EgressRule], *, listen: str, upstream_ca: bool) -> tuple[list[str], list[str],
                                                                                           list[str]]:
    """The squid directives of a ticket with rules: (setup, leading http_access
    denials, ssl_bump and the rules' http_access), placed by egress.squid_conf."""
    hosts = sorted({r.host for r in rules})
    setup = [
        (f"http_port {listen} ssl-bump tls-cert={TLS_DIR}/ca.pem tls-key={TLS_DIR}/ca.key "
        "generate-host-certificates=on dynamic_cert_mem_cache_size=4MB"),
        f"sslcrtd_program {CERTGEN} -s {TLS_DIR}/db -M 4MB",
        # helpers start with the first decrypted connection, not before squid listens: on the
        # proxy's half CPU they would hold back the sandbox's first command (make bench)
        "sslcrtd_children 2 startup=0 idle=1",
        *([f"tls_outgoing_options cafile={BUMP_MOUNT}/{UPSTREAM_CA}"] if upstream_ca else []),
        ("external_acl_type afe_judge children-max=2 children-startup=0 concurrency=32 ttl=3600 "
        "negative_ttl=3600 cache=4096 %>rm %>rd %>rp %>ha{Upgrade} "
        f"/usr/bin/python3 -I {BUMP_MOUNT}/{JUDGE} {BUMP_MOUNT}/{RULES}"),
        f"error_directory {TLS_DIR}/errors",
        f"acl rule_hosts dstdomain -n {' '.join(hosts)}",
        f"acl rule_sni ssl::server_name {' '.join(hosts)}",
        "acl judged external afe_judge",
        "acl in_tunnel connections_encrypted",
        "acl step1 at_step SslBump1",
        "deny_info ERR_AFE_EGRESS judged",
        "deny_info ERR_AFE_TUNNEL in_tunnel",
    ]
    first = ["http_access deny CONNECT in_tunnel"]
    judged = [
        "http_access deny !CONNECT rule_hosts !judged",
        # a host with rules is decrypted from the start; any other is spliced after a look at
        # its ClientHello, which must not name a host with rules (it would pass unjudged)
        "ssl_bump bump step1 rule_hosts",
        "ssl_bump peek step1",
        "ssl_bump terminate rule_sni",
        "ssl_bump splice all",
        "on_unsupported_protocol tunnel !rule_hosts",
    ]
    return setup, first, judged
