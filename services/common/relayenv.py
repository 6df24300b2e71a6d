"""How an agent process finds the model relay (R32): the relay's address
inside the sandbox and the environment an agent gets for its Model.

The sandbox broker mounts the ticket's relay folder read-only at
`RELAY_MOUNT` and runs a forwarder on the sandbox's own loopback at
`RELAY_PORT`; the relay serves each declared Model under `/m/<model name>/`
and each granted MCP server at `/mcp/<server name>` (R43).
An agent's `relay_env` maps variable NAMES to templates of `{base_url}`,
`{capability}` (the ticket's placeholder credential) and `{model}` (the
Model's model id); an agent without one gets its provider's default below.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

RELAY_PORT = 7480                      # the forwarder inside the sandbox, on 127.0.0.1
RELAY_MOUNT = "/run/afe-relay"         # the ticket's relay folder, read-only, inside the sandbox
RELAY_SOCKET = "relay.sock"            # the socket in that folder (served by the credential broker)
TEMPLATE_FIELDS = ("base_url", "capability", "model")
RELAY_PROVIDERS = ("anthropic", "openai", "gemini")

DEFAULT_RELAY_ENV: dict[str, tuple[tuple[str, str], ...]] = {
    "anthropic": (("ANTHROPIC_BASE_URL", "{base_url}"), ("ANTHROPIC_API_KEY", "{capability}")),
    "openai": (("OPENAI_BASE_URL", "{base_url}/v1"), ("OPENAI_API_KEY", "{capability}")),
    "gemini": (("GOOGLE_GEMINI_BASE_URL", "{base_url}"), ("GEMINI_API_KEY", "{capability}")),
}


def relay_base_url(model_name: str) -> str:
    """The base URL an agent uses for `model_name`, inside the sandbox (no trailing slash)."""
    return f"http://127.0.0.1:{RELAY_PORT}/m/{model_name}"


def relay_mcp_url(server_name: str) -> str:
    """The URL an agent uses for MCP server `server_name`, inside the sandbox (R43)."""
    return f"http://127.0.0.1:{RELAY_PORT}/mcp/{server_name}"


def template_problem(template: str) -> str | None:
    """Why `template` is not a valid relay_env template, or None."""
    try:
        fields = [f for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        return f"is not a valid template ({exc}); write {{base_url}}, {{capability}} or {{model}}, and {{{{ for a brace"
    for f in fields:
        if f not in TEMPLATE_FIELDS:
            return (f"uses {{{f}}}; a template may use only "
                    + ", ".join("{" + t + "}" for t in TEMPLATE_FIELDS))
    return None


def relay_env(templates: Iterable[tuple[str, str]], *, provider: str, model_name: str, model_id: str,
              capability: str) -> dict[str, str]:
    """NAME -> value for the agent's process: the agent's templates, or its provider's default."""
    pairs = tuple(templates) or DEFAULT_RELAY_ENV.get(provider, ())
    values = {"base_url": relay_base_url(model_name), "capability": capability, "model": model_id}
    return {name: t.format(**values) for name, t in pairs}
