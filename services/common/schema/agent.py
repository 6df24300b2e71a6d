"""kind: Agent — an ACP coding agent: its command, the variable NAMES it
may receive (env, R9; never one that holds a secret afe keeps, R43:
sandboxenv.py), its Model through the relay (model, relayEnv, R32),
a preset (claude-code, codex, gemini, opencode) and literal switches
(fixedEnv).

`AgentManifest` declares the fields; `load` checks one document and adds a
`config.Agent` (with `presets.apply_preset` filling what it leaves out)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.common.config.model import Agent
from services.common.config.presets import PRESETS, apply_preset, check_fixed_env

from ..relayenv import template_problem
from .document import Doc
from .text import ENV_NAME_RE, NAME_RE, fields_of

if TYPE_CHECKING:
    from .collected import Collected as Loader

EnvName = Annotated[str, StringConstraints(pattern=ENV_NAME_RE.pattern)]
PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]


class AgentManifest(BaseModel):
    """An ACP agent run inside the ticket's sandbox. Write command:, or preset: (or both)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True,
                              json_schema_extra={"anyOf": [{"required": ["command"]}, {"required": ["preset"]}]})
    kind: Literal["Agent"]
    name: Annotated[str, StringConstraints(pattern=NAME_RE.pattern)]
    type: Literal["acp"]
    command: list[Annotated[str, StringConstraints(min_length=1)]] | None = Field(
        None, min_length=1, description="the argv of the ACP agent (repeated items allowed); default: the preset's")
    env: list[EnvName] = Field(default_factory=list, description="variable NAMES passed into the sandbox (R9); "
                                  "never a Model's apiKeyEnv or a Workspace's or McpServer's tokenEnv (R43)")
    image: str | None = Field(None, description="the sandbox image; default: the preset's")
    model: Annotated[str, StringConstraints(pattern=NAME_RE.pattern)] | None = Field(
        None, description="a Model the agent reaches through the relay (R32)")
    relayEnv: dict[EnvName, str] = Field(
        default_factory=dict, description="NAME -> template of {base_url}, {capability}, {model}; default: "
        "the Model provider's")
    preset: PresetName | None = None  # type: ignore[valid-type]
    fixedEnv: dict[EnvName, str | int | bool] = Field(
        default_factory=dict, description="NAME -> a literal, non-secret value set in the agent's process")


def load(loader: Loader, doc: Doc, d: Mapping[str, Any], name: str | None) -> None:
    doc.fields(d, "", fields_of(AgentManifest), ("type",) if "preset" in d else ("type", "command"),
               hint="" if "preset" in d else " (or preset: one of " + ", ".join(PRESETS) + ")")
    atype = doc.choice(d, "type", "type", ("acp",))
    # An argv: repeated items are meaningful (`[codex-acp, -c, a=1, -c, b=2]`).
    command = doc.str_list(d, "command", "command", nonempty="command" in d, unique=False)
    env = doc.str_list(d, "env", "env", pattern=ENV_NAME_RE,
                       what="list environment variable NAMES (A-Z, 0-9, _), never values")
    image = doc.text(d, "image", "image", None)
    model = doc.text(d, "model", "model", None, pattern=NAME_RE, what="write the name of a Model manifest")
    relay_env = _relay_env(loader, doc, d, env)
    if relay_env and model is None:
        doc.error("relayEnv", "only an agent with model: gets the relay's variables; add model: <Model name>")
    preset = doc.choice(d, "preset", "preset", tuple(PRESETS))
    fixed_env = _fixed_env(loader, doc, d, env, relay_env)
    if doc.named and name is not None and atype is not None and (command or preset is not None):
        # Which env names may enter the sandbox is checked once every document is read
        # (sandboxenv.py, R43): it depends on the Models, Workspaces and McpServers.
        loader.agents[name] = apply_preset(Agent(name=name, type=atype, command=command, env=env, image=image,
                                                 model=model, relay_env=relay_env, fixed_env=fixed_env,
                                                 source=doc.where), preset)


def _fixed_env(loader: Loader, doc: Doc, d: Mapping[str, Any], secret_names: tuple[str, ...],
              relay_env: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """fixedEnv: NAME -> a literal, non-secret value set in the agent's process (presets.py)."""
    raw = doc.mapping(d, "fixedEnv", "fixedEnv") or {}
    relay_names = {k for k, _ in relay_env}
    out: list[tuple[str, str]] = []
    for k, v in raw.items():
        path = f"fixedEnv.{k}"
        if not isinstance(k, str) or not ENV_NAME_RE.match(k):
            doc.error("fixedEnv", "a key is not an environment variable name: use A-Z, 0-9 and _")
            continue
        if k in secret_names or k in relay_names:
            doc.error(path, f"{k} is also in {'env' if k in secret_names else 'relayEnv'}; a variable "
                      "comes from one place only: remove one of them")
            continue
        if isinstance(v, bool):
            v = "1" if v else "0"
        elif isinstance(v, int):
            v = str(v)
        if not isinstance(v, str):
            doc.error(path, "must be a text value (quote it: '1', 'false')")
            continue
        problem = check_fixed_env(k, v)
        if problem:
            doc.error(path, problem)
            continue
        out.append((k, v))
    return tuple(out)


def _relay_env(loader: Loader, doc: Doc, d: Mapping[str, Any], secret_names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """relayEnv: NAME -> template of {base_url}, {capability}, {model} (R32)."""
    raw = doc.mapping(d, "relayEnv", "relayEnv") or {}
    out: list[tuple[str, str]] = []
    for k, v in raw.items():
        path = f"relayEnv.{k}"
        if not isinstance(k, str) or not ENV_NAME_RE.match(k):
            doc.error(path, "names an environment variable: use A-Z, 0-9 and _")
            continue
        if k in secret_names:
            doc.error(path, f"{k} is also in env (a secret passed by name); a variable comes from one "
                      "place only: remove it from env or from relayEnv")
            continue
        if not isinstance(v, str):
            doc.error(path, "must be a text template such as '{base_url}' or '{capability}'")
            continue
        problem = template_problem(v)
        if problem:
            doc.error(path, problem)
            continue
        out.append((k, v))
    return tuple(out)

