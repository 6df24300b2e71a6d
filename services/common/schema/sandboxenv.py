"""Which variables an Agent's `env:` may take into the sandbox (R9, R32, R43).

An Agent's `env:` names variables whose VALUES, read from `afe up`'s
environment by the sandbox broker, enter the agent's process in the sandbox,
where the agent can read them. So a name that holds a secret afe keeps on the
host is refused, with or without `preset:` (`refusals`, run by the loader
once every document is read, so `afe check` and `afe up` refuse alike):

- a name a Model (`apiKeyEnv`), a Workspace (`tokenEnv`) or an McpServer
  (`tokenEnv`) of the same config folder holds its secret in;
- a name the relay or the preset sets in the agent's process itself (its
  `relayEnv` or its provider's default, its `fixedEnv`);
- the names the coding tools and forges read their keys and tokens from
  (`KNOWN_SECRET_NAMES`), even when no manifest names them: the README's
  old `env: [ANTHROPIC_API_KEY]` put the real key into the sandbox.

Each error says what to write instead (`model:` and the relay, a
Workflow's `mcp:`, or nothing: afe pushes itself). Every other name stays
allowed (the seed lets an agent declare variables), and `warnings` lists it
for `afe check` and the `afe up` banner."""

from __future__ import annotations

from services.common.config.model import Agent, Config
from services.common.config.presets import PRESETS

from ..relayenv import DEFAULT_RELAY_ENV
from .collected import Collected
from .text import show

__all__ = ["KNOWN_SECRET_NAMES", "refusals", "warnings"]

_MODEL_KEY = "model key"
_FORGE_TOKEN = "forge token"
# Where the coding tools and forge CLIs read their credentials: the relay's capability variables
# of every provider and preset, and the other names those tools take a key or token from.
KNOWN_SECRET_NAMES: dict[str, str] = {
    **{name: _MODEL_KEY for pairs in (*DEFAULT_RELAY_ENV.values(), *(p.relay_env for p in PRESETS.values()))
       for name, template in pairs if "{capability}" in template},
    "ANTHROPIC_AUTH_TOKEN": _MODEL_KEY, "CLAUDE_CODE_OAUTH_TOKEN": _MODEL_KEY, "GOOGLE_API_KEY": _MODEL_KEY,
    "GITHUB_TOKEN": _FORGE_TOKEN, "GH_TOKEN": _FORGE_TOKEN, "GH_ENTERPRISE_TOKEN": _FORGE_TOKEN,
    "GITHUB_ENTERPRISE_TOKEN": _FORGE_TOKEN,
}


def refusals(loader: Collected) -> list[str]:
    """One error per refused name of every Agent's env:, as `file.yaml#N env: ...`."""
    held = Config(directory=loader.directory, workspaces=loader.workspaces, models=loader.models,
                  mcp_servers=loader.mcp_servers).secret_env_names()
    out: list[str] = []
    for a in loader.agents.values():
        own = _set_by_afe(loader, a)
        for name in a.env:
            why = _refusal(name, held.get(name), own.get(name))
            if why:
                out.append(f"{a.source} env: {why}")
    return out


def warnings(config: Config) -> list[str]:
    """A line per name an Agent passes into the sandbox (allowed, but its value is readable there)."""
    out = []
    for a in sorted(config.agents.values(), key=lambda a: a.name):
        for name in a.env:
            out.append(f"agent {a.name}: env: {name} enters the sandbox with its value from the environment "
                       "of `afe up`, where the agent process can read it (R9). If it holds a "
                       "secret, let afe hold it instead: a Model (model:) for a model key, an McpServer "
                       "(tokenEnv:) for a tool's token (docs/MCP.md)")
    return out


def _set_by_afe(loader: Collected, a: Agent) -> dict[str, str]:
    """NAME -> who sets it in the agent's process: the relay (relayEnv or the provider's default), a
    preset's or the manifest's fixedEnv."""
    who = f"preset {a.preset}" if a.preset else "afe"
    out = {k: f"{who} sets {k} itself (as a fixed value)" for k, _ in a.fixed_env}
    relay = a.relay_env
    m = loader.models.get(a.model or "")
    if not relay and m is not None:
        relay = DEFAULT_RELAY_ENV.get(m.provider, ())
    if a.model:
        out.update({k: f"{who} sets {k} itself (from the relay: the Model's address or the ticket's "
                       "capability)" for k, _ in relay})
    return out


def _refusal(name: str, held_by: tuple[str, str] | None, set_by_afe: str | None) -> str | None:
    if held_by is not None:
        kind, holder = held_by
        field = "apiKeyEnv" if kind == "Model" else "tokenEnv"
        if kind == "Model":
            return (f"{name} holds the key of Model {show(holder)} ({field}); a model key never enters the "
                    f"sandbox (R32, R43): remove it from env and write model: {holder} — the agent then "
                    "reaches the model through the ticket's relay, with a per-ticket capability in place of "
                    "the key (docs/AGENTS.md)")
        if kind == "Workspace":
            return (f"{name} holds the token of Workspace {show(holder)} ({field}); git and forge tokens never "
                    "enter a sandbox (R13, R43): remove it from env — afe clones, pushes and opens the pull "
                    "request itself, on the host (builtin:open_pr)")
        return (f"{name} holds the credential of McpServer {show(holder)} ({field}); a tool's credential never "
                f"enters a sandbox (R43): remove it from env and grant the server's tools in the Workflow "
                f"(mcp: {{{holder}: [tool, ...]}}) — the credential broker's relay adds the credential "
                "(docs/MCP.md)")
    if set_by_afe is not None:
        return (f"{set_by_afe}; remove it from env: a model key never enters the sandbox, the agent gets the "
                "relay's per-ticket capability instead (R32)")
    known = KNOWN_SECRET_NAMES.get(name)
    if known == _MODEL_KEY:
        return (f"{name} is where coding agents read a model key, and its value would enter the sandbox; a "
                "model key never does (R32, R43): remove it from env, declare a Model (apiKeyEnv: "
                f"{name}) and write model: <that Model's name> in this Agent — the agent then reaches the "
                "model through the ticket's relay, with a per-ticket capability in place of the key "
                "(docs/AGENTS.md)")
    if known == _FORGE_TOKEN:
        return (f"{name} is where forge CLIs read a token, and its value would enter the sandbox; git and "
                "forge tokens never do (R13, R15): remove it from env — afe pushes and opens the pull "
                "request itself (builtin:open_pr, a Workspace's tokenEnv)")
    return None
