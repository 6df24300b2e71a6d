"""The environment of every process afe starts (R33).

No afe process lets a child inherit its environment: the launcher holds
everything the user exported (git tokens, model keys, OTLP headers), and a
broker's environment holds what the launcher gave it. Each child gets a
dictionary built here from an allowlist: `PATH HOME LANG TZ` plus exactly
the names its tool reads. `tests/foundation/test_child_env.py` scans the
code for any process start without `env=`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

BASE_NAMES = ("PATH", "HOME", "LANG", "TZ")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# What the docker CLI reads to find and authenticate to the engine.
DOCKER_CLI_NAMES = ("DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_CONFIG", "DOCKER_CERT_PATH", "DOCKER_TLS_VERIFY",
                    "DOCKER_BUILDKIT")
# HTTP(S) proxies as curl, git, apt and debootstrap read them (both spellings).
PROXY_NAMES = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")


def tool_env(names: Iterable[str] = (), *, environ: Mapping[str, str] | None = None,
             fixed: Mapping[str, str] | None = None) -> dict[str, str]:
    """`PATH HOME LANG TZ` and `names` taken from `environ` (default: this
    process's), then `fixed` on top; PATH is always set."""
    src = os.environ if environ is None else environ
    env = {n: src[n] for n in (*BASE_NAMES, *names) if n in src}
    env.setdefault("PATH", DEFAULT_PATH)
    if fixed:
        env.update(fixed)
    return env


def docker_cli_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """For `docker version`, `docker image inspect`, `docker build`, `docker pull`."""
    return tool_env(DOCKER_CLI_NAMES, environ=environ)


def proxy_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The proxy variables the operator set (none when unset)."""
    src = os.environ if environ is None else environ
    return {n: src[n] for n in PROXY_NAMES if src.get(n)}


__all__ = ["BASE_NAMES", "DEFAULT_PATH", "DOCKER_CLI_NAMES", "PROXY_NAMES", "docker_cli_env", "proxy_env",
           "tool_env"]
