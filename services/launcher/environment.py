"""Which environment variables each process receives (R33; docs/OPERATIONS.md).

Every child starts from an EMPTY environment: `PATH HOME LANG TZ` plus only
the names its role needs. The credential broker gets exactly the `tokenEnv` /
`apiKeyEnv` names the manifests mention, `AFE_CA_FILE` and the HTTP(S) proxy
variables (for its git and HTTPS calls); the sandbox broker exactly the names
`acp` agents declare (+ `DOCKER_HOST`, and `AFE_CA_FILE` for the egress proxies
that decrypt, R44), the gateway the UI token and the
GitHub webhook secret (`AFE_GITHUB_WEBHOOK_SECRET`), the
scheduler the store URL, and the credential broker that URL too when it names
PostgreSQL (the fences are checked in that database, services/credentials/fencing/database.py);
every child gets the `OTEL_*` exporter settings.
The table of every operator setting and the process it reaches is in
docs/OPERATIONS.md ("Operator settings").
"""

from __future__ import annotations

from collections.abc import Mapping

from services.common.config.model import Config
from services.common.secrecy.childenv import BASE_NAMES, PROXY_NAMES

SERVICES = ("sandbox", "credentials", "scheduler", "gateway")
GITHUB_WEBHOOK_SECRET_ENV = "AFE_GITHUB_WEBHOOK_SECRET"
DATABASE_ENV = "AFE_DATABASE_URL"


def shared_store(environ: Mapping[str, str]) -> bool:
    """AFE_DATABASE_URL names a PostgreSQL database (several schedulers may share it)."""
    return environ.get(DATABASE_ENV, "").split(":", 1)[0].strip().lower() in ("postgresql", "postgres")


def allowed_names(service: str, config: Config, environ: Mapping[str, str]) -> list[str]:
    """The variable names `service` may receive (those present in `environ` are passed)."""
    names = list(BASE_NAMES)
    if service == "credentials":
        names += config.credential_env_names()
        names += ["AFE_CA_FILE", *PROXY_NAMES]
        if shared_store(environ):   # the fences live in the shared store (R37): never a SQLite path
            names.append(DATABASE_ENV)
    elif service == "sandbox":
        names += config.agent_env_names()
        # DOCKER_HOST; AFE_CA_FILE: the CAs a decrypting egress proxy trusts for upstreams (R44)
        names += ["DOCKER_HOST", "AFE_CA_FILE"]
    elif service == "gateway":
        # The GitHub webhook secret (docs/GITHUB.md, R35) reaches the gateway and nothing else.
        names += ["AFE_UI_TOKEN", GITHUB_WEBHOOK_SECRET_ENV]
    elif service == "scheduler":
        names.append(DATABASE_ENV)
    else:
        raise ValueError(f"unknown service {service}")
    names += sorted(n for n in environ if n.startswith("OTEL_"))
    return list(dict.fromkeys(names))


def child_env(service: str, config: Config, environ: Mapping[str, str]) -> dict[str, str]:
    """The complete environment for `service`: nothing else is inherited."""
    env = {n: environ[n] for n in allowed_names(service, config, environ) if n in environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    return env
