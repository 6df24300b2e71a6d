"""Loading and validating the manifests of a config folder (docs/GUIDE.md).

`load_config(dir)` reads every `*.yaml`/`*.yml` file in the folder (several
documents per file), validates every document and returns a `Config`. All
problems are collected and raised together as one `ConfigError` whose lines
read `file.yaml#<document number> <field.path>: <what is wrong and what to
change>`. Documents are numbered from 1 in the order they appear in a file.

A value that looks like a secret is refused in ANY field; the error names the
field and the kind of secret, never the value (R27, R28): `Loader.scan_secrets`
runs over every document before its kind's checks. No other error message
echoes a value that could be a secret either (see `text.show`).

Each kind's fields and checks are in its own module (workspace, model, agent,
mcp, workflow, trigger); this one dispatches on `kind:` and checks what spans
documents (names, references, cycles, MCP grants, and the variables an
Agent's env: may take into the sandbox: sandboxenv.py, R43).

Files referenced as a replay model's `script` are data, not manifests, and
are skipped when they sit in the same folder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from services.common.config.model import Config, Node, Workflow
from services.common.config.presets import PRESETS
from services.common.config.templates import check as check_template
from services.common.secrecy.redact import secret_kind

from ..errors import ConfigError, InvalidArgument
from ..relayenv import DEFAULT_RELAY_ENV, RELAY_PROVIDERS
from . import agent, mcp, model, sandboxenv, trigger, workflow, workspace
from .collected import Collected
from .document import Doc
from .text import KINDS, NAME_RE, NAME_WHAT, show

__all__ = ["Loader", "load_config", "missing_env"]

LOADERS: dict[str, Callable[[Loader, Doc, Mapping[str, Any], str | None], None]] = {
    "Workspace": workspace.load, "Model": model.load, "Agent": agent.load, "McpServer": mcp.load,
    "Workflow": workflow.load, "Trigger": trigger.load,
}


class Loader(Collected):
    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.errors: list[str] = []
        self.seen: dict[tuple[str, str], str] = {}

    # -- secrets ------------------------------------------------------------

    def scan_secrets(self, doc: Doc, obj: Any, path: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                key = str(k)
                kind = secret_kind(key)
                if kind:
                    doc.secret(path or "(document)", kind)
                    continue
                self.scan_secrets(doc, v, f"{path}.{key}" if path else key)
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                self.scan_secrets(doc, v, f"{path}[{i}]")
        elif isinstance(obj, str):
            # Whole value, then each word: secret_kind spots a URL's password only in a lone URL.
            kind = secret_kind(obj) or next((k for w in obj.split() if (k := secret_kind(w))), None)
            if kind:
                doc.secret(path, kind)

    # -- documents ----------------------------------------------------------

    def add_named(self, doc: Doc, kind: str, name: str) -> bool:
        prev = self.seen.get((kind, name))
        if prev is not None:
            doc.error("name", f"a {kind} named {show(name)} is already defined at {prev}; names must be "
                      "unique per kind, rename one of them")
            return False
        self.seen[(kind, name)] = doc.where
        return True

    def load_doc(self, doc: Doc) -> None:
        data = doc.data
        kind = data.get("kind")
        if kind is None:
            doc.error("kind", f"required field is missing; add kind: one of {', '.join(KINDS)}")
            return
        if kind not in KINDS:
            doc.error("kind", f"unknown kind {show(kind)}; use one of {', '.join(KINDS)}")
            return
        name = doc.text(data, "name", "name", None, pattern=NAME_RE,
                        what=NAME_WHAT)
        if "name" not in data or data["name"] is None:
            doc.error("name", "required field is missing; add name: <a unique name>")
        elif name is not None:
            doc.named = self.add_named(doc, kind, name)
        LOADERS[kind](self, doc, data, name)


    def check_trigger_references(self) -> None:
        for tr in self.triggers.values():
            where = tr.source
            ws = self.workspaces.get(tr.workspace)
            if ws is None:
                self.errors.append(f"{where} workspace: no Workspace named {show(tr.workspace)}; "
                                   f"defined: {', '.join(sorted(self.workspaces)) or 'none'}")
            elif ws.forge.type != "github":
                self.errors.append(f"{where} workspace: Workspace {show(tr.workspace)} has a "
                                   f"{ws.forge.type} forge; a Trigger needs forge: {{type: github, repo: owner/name}}")
            wf = self.workflows.get(tr.workflow)
            if wf is None:
                self.errors.append(f"{where} workflow: no Workflow named {show(tr.workflow)}; "
                                   f"defined: {', '.join(sorted(self.workflows)) or 'none'}")
                continue
            for k, _ in tr.inputs:
                if k not in wf.inputs:
                    self.errors.append(f"{where} inputs.{k}: Workflow {show(wf.name)} declares no input "
                                       f"{show(k)}; declared: {', '.join(wf.inputs) or 'none'} (add it to "
                                       "the workflow's inputs or remove it here)")
            given = {k for k, _ in tr.inputs}
            for k in wf.required_inputs:
                if k not in given:
                    self.errors.append(f"{where} inputs: Workflow {show(wf.name)} needs input {show(k)}; map "
                                       f"it here (inputs: {{{k}: issue.title}}) or give it a default in the "
                                       "workflow")

    def check_references(self) -> None:
        self.check_trigger_references()
        for wf in self.workflows.values():
            where = wf.source
            if wf.workspace is not None and ("Workspace", wf.workspace) not in self.seen:
                self.errors.append(f"{where} workspace: no Workspace named {show(wf.workspace)}; "
                                   f"defined: {', '.join(sorted(self.workspaces)) or 'none'}")
            ids = {n.id for n in wf.nodes}
            raw_nodes = self._raw_nodes.get(wf.name, [])
            index: dict[Any, int] = {}
            for i, r in enumerate(raw_nodes):
                if isinstance(r, dict):
                    index.setdefault(r.get("id"), i)
            for n in wf.nodes:
                p = f"nodes[{index.get(n.id, '?')}]"
                if n.kind == "model" and ("Model", n.model) not in self.seen:
                    self.errors.append(f"{where} {p}.model: no Model named {show(n.model)}; "
                                       f"defined: {', '.join(sorted(self.models)) or 'none'}")
                elif n.kind == "model" and n.model in self.models and self.models[n.model].provider == "gemini":
                    self.errors.append(f"{where} {p}.model: Model {show(n.model)} is a gemini model, which "
                                       "only agents can use (through the relay); use an openai or anthropic "
                                       "Model for a model node")
                if n.kind == "agent" and ("Agent", n.agent) not in self.seen:
                    self.errors.append(f"{where} {p}.agent: no Agent named {show(n.agent)}; "
                                       f"defined: {', '.join(sorted(self.agents)) or 'none'}")
                for dep in n.needs:
                    if dep not in ids:
                        self.errors.append(f"{where} {p}.needs: {show(dep)} is not a node id of this "
                                           f"workflow; ids: {', '.join(sorted(ids))}")
                    elif dep == n.id:
                        self.errors.append(f"{where} {p}.needs: a node cannot need itself")
            by_id = {n.id: n for n in wf.nodes}
            for n in wf.nodes:
                if n.retry_from is None:
                    continue
                p = f"nodes[{index.get(n.id, '?')}].on_failure.retry_from"
                target = by_id.get(n.retry_from)
                if target is None or target.kind not in ("model", "agent"):
                    self.errors.append(f"{where} {p}: {show(n.retry_from)} is not a model or agent node of this "
                                       "workflow; name the node that writes the change this node checks")
                elif not _needs_transitively(by_id, n.id, n.retry_from):
                    self.errors.append(f"{where} {p}: node {show(n.id)} does not need {show(n.retry_from)}; "
                                       "retry_from must run before it (add it to `needs`)")
            cycle = _find_cycle(wf.nodes)
            if cycle:
                self.errors.append(f"{where} nodes: dependency cycle {' -> '.join(cycle)}; remove one of "
                                   "these needs")
            else:
                self.check_templates(wf, index)

        for a in self.agents.values():
            if a.model is None:
                continue
            m = self.models.get(a.model)
            if m is None:
                if ("Model", a.model) not in self.seen:
                    self.errors.append(f"{a.source} model: no Model named {show(a.model)}; "
                                       f"defined: {', '.join(sorted(self.models)) or 'none'}")
            elif m.provider not in RELAY_PROVIDERS:
                self.errors.append(f"{a.source} model: Model {show(a.model)} has provider {m.provider}, which "
                                   f"has no HTTP API an agent can call; use one of: {', '.join(RELAY_PROVIDERS)}")
            elif a.preset in PRESETS and m.provider not in PRESETS[a.preset].providers:
                want = " or ".join(PRESETS[a.preset].providers)
                self.errors.append(f"{a.source} model: preset {a.preset} talks to {want} models, but Model "
                                   f"{show(a.model)} has provider {m.provider}; name a Model of provider {want} or "
                                   "choose the preset of that provider (docs/AGENTS.md)")
            elif not a.relay_env and m.provider not in DEFAULT_RELAY_ENV:
                self.errors.append(f"{a.source} relayEnv: provider {m.provider} has no default; list the "
                                   "variables the agent reads")
        self.errors.extend(sandboxenv.refusals(self))
        self.errors.extend(mcp.grant_problems(self, {n for k, n in self.seen if k == "McpServer"}))

    def check_templates(self, wf: Workflow, index: Mapping[Any, int]) -> None:
        """Every `{{...}}` in a run line, prompt or builtin text names what that node can see:
        ticket fields, a declared input, or the output of a node that runs before it."""
        needs = {n.id: set(n.needs) for n in wf.nodes}
        for n in wf.nodes:
            earlier: set[str] = set()
            todo = list(needs.get(n.id, ()))
            while todo:
                dep = todo.pop()
                if dep not in earlier and dep in needs:
                    earlier.add(dep)
                    todo.extend(needs[dep])
            p = f"nodes[{index.get(n.id, '?')}]"
            texts = [("run", n.run or "", True)] if n.kind == "run" else []
            if n.kind in ("model", "agent"):
                texts.append(("prompt", n.prompt or "", False))
            texts += [(f"with.{k}", str(v), False) for k, v in (n.with_ or {}).items()]
            for field, text, command in texts:
                try:
                    check_template(text, earlier, wf.inputs, f"{wf.source} {p}.{field}", command=command)
                except InvalidArgument as exc:
                    self.errors.append(exc.message)

    def config(self) -> Config:
        return Config(directory=self.directory, workspaces=self.workspaces, models=self.models,
                      agents=self.agents, workflows=self.workflows, triggers=self.triggers,
                      mcp_servers=self.mcp_servers)


def _needs_transitively(by_id: dict[str, Node], node: str, ancestor: str) -> bool:
    seen: set[str] = set()
    todo = list(by_id[node].needs)
    while todo:
        d = todo.pop()
        if d == ancestor:
            return True
        if d not in seen and d in by_id:
            seen.add(d)
            todo.extend(by_id[d].needs)
    return False


def _find_cycle(nodes: tuple[Node, ...]) -> list[str] | None:
    graph = {n.id: [d for d in n.needs if d != n.id] for n in nodes}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if state.get(w) == 1:
                return [*stack[stack.index(w):], w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for n in graph:
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _manifest_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir()
                  if p.is_file() and p.suffix in (".yaml", ".yml") and not p.name.startswith("."))


def load_config(directory: str | Path) -> Config:
    """Load and validate every manifest in `directory`; raise ConfigError listing every problem."""
    directory = Path(directory).expanduser().absolute()
    if not directory.is_dir():
        raise ConfigError(f"config folder {directory} does not exist; create it or pass --config DIR")
    loader = Loader(directory)
    parsed: list[tuple[Path, int, Any]] = []
    for path in _manifest_files(directory):
        try:
            docs = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(exc, "problem", None) or "not valid UTF-8 YAML"
            loader.errors.append(f"{path.name}{at}: {problem}; fix the YAML syntax")
            continue
        for i, data in enumerate(docs, start=1):
            if data is not None:
                parsed.append((path, i, data))
    # Files named as replay scripts are data, not manifests.
    scripts: set[Path] = set()
    for _path, _, data in parsed:
        if isinstance(data, dict) and data.get("kind") == "Model" and isinstance(data.get("script"), str):
            s = Path(data["script"]).expanduser()
            scripts.add((s if s.is_absolute() else directory / s).resolve())
    count = 0
    for path, i, data in parsed:
        if path.resolve() in scripts:
            continue
        where = f"{path.name}#{i}"
        if not isinstance(data, dict):
            loader.errors.append(f"{where} (document): must be a mapping with kind: and name:")
            continue
        doc = Doc(loader.errors, where, data)
        loader.scan_secrets(doc, data, "")
        loader.load_doc(doc)
        count += 1
    if count == 0 and not loader.errors:
        loader.errors.append(f"{directory}: no manifests found; add a *.yaml file with at least one "
                             "Workspace and one Workflow (see README.md, Configuration)")
    loader.check_references()
    if loader.errors:
        raise ConfigError(f"{len(loader.errors)} problem(s) in {directory}:\n"
                          + "\n".join(f"  {e}" for e in loader.errors))
    return loader.config()


def missing_env(config: Config, environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """Every variable a manifest names that is unset (or empty) in `environ`.

    Returns (NAME, where) pairs such as ("SHOP_TOKEN", "afe.yaml#1 Workspace shop tokenEnv").
    Never looks at or returns a value beyond "is it set".
    """
    wanted: list[tuple[str, str]] = []
    for w in config.workspaces.values():
        if w.token_env:
            wanted.append((w.token_env, f"{w.source} Workspace {w.name} tokenEnv"))
    for m in config.models.values():
        if m.api_key_env:
            wanted.append((m.api_key_env, f"{m.source} Model {m.name} apiKeyEnv"))
    for s in config.mcp_servers.values():
        if s.token_env:
            wanted.append((s.token_env, f"{s.source} McpServer {s.name} tokenEnv"))
    for a in config.agents.values():
        for n in a.env:
            wanted.append((n, f"{a.source} Agent {a.name} env"))
    return [(name, where) for name, where in wanted if not environ.get(name)]
