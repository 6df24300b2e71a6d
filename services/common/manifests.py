"""Loading and validating the manifests of a config folder (DESIGN §2).

`load_config(dir)` reads every `*.yaml`/`*.yml` file in the folder (several
documents per file), validates every document and returns a `Config`. All
problems are collected and raised together as one `ConfigError` whose lines
read `file.yaml#<document number> <field.path>: <what is wrong and what to
change>`. Documents are numbered from 1 in the order they appear in a file.

A value that looks like a secret is refused in ANY field; the error names the
field and the kind of secret, never the value (R27, R28). No other error
message echoes a value that could be a secret either (see `_show`).

Files referenced as a replay model's `script` are data, not manifests, and
are skipped when they sit in the same folder.
"""

from __future__ import annotations

import ipaddress
import math
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .config import (
    BUILTINS,
    DEFAULT_SANDBOX_IMAGE,
    NODE_TOOLS,
    TRIGGER_FIELDS,
    Agent,
    Author,
    Config,
    ForgeConfig,
    Limits,
    Model,
    Node,
    SandboxConfig,
    Trigger,
    Workflow,
    Workspace,
)
from .errors import ConfigError
from .presets import PRESETS, apply_preset, check_fixed_env
from .redact import secret_kind
from .relayenv import DEFAULT_RELAY_ENV, RELAY_PROVIDERS, template_problem

__all__ = ["KINDS", "load_config", "missing_env", "parse_memory"]

KINDS = ("Workspace", "Model", "Agent", "Workflow", "Trigger")
PROVIDERS = ("openai", "anthropic", "gemini", "replay")
FORGES = ("github", "local")
MERGE_METHODS = ("merge", "squash", "rebase")
# ACP tool-call kinds an agent node may deny.
PERMISSION_KINDS = ("read", "edit", "delete", "move", "search", "execute", "think", "fetch",
                    "switch_mode", "other")
BUILTIN_WITH = {
    "commit": ("message",),
    "open_pr": ("title", "body"),
    "approval": ("message",),
    "merge": ("method",),
}
DEFAULT_BASE_URLS = {"openai": "https://api.openai.com/v1", "anthropic": "https://api.anthropic.com",
                     "gemini": "https://generativelanguage.googleapis.com"}

ENV_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
NODE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
INPUT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
HOST_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
EGRESS_RE = re.compile(rf"^\.?(?:{HOST_LABEL}\.)*{HOST_LABEL}$")
GITHUB_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*/[A-Za-z0-9._-]+$")
GITHUB_LOGIN_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})(?:\[bot\])?$")
COMMAND_RE = re.compile(r"^/[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3, "t": 1024 ** 4}
MIN_MEMORY = 6 * 1024 * 1024   # Docker's own minimum
MIN_DISK = 16 * 1024 * 1024    # smallest workspace disk cap (R34): a filesystem and a checkout must fit
MAX_DISK = 16 * 1024 ** 4

_MISSING = object()
# Never allowed by sandbox.egressPrivate (mirrors services/sandbox/egress.py NEVER_RANGES).
_NEVER_NETS = tuple(ipaddress.ip_network(r) for r in (
    "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4",
    "::/128", "::1/128", "::ffff:0:0/96", "fe80::/10", "ff00::/8"))


def parse_memory(value: object) -> int | None:
    """`512m`, `2g`, `1.5GiB` or a byte count -> bytes; None when not a size."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = MEMORY_RE.match(value)
        if m:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return None


def _show(value: object) -> str:
    """Quote a user-written value in an error only when it cannot be a secret."""
    text = str(value)
    if len(text) > 64 or secret_kind(text) is not None:
        return "(value hidden)"
    return repr(text)


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Doc:
    """One document being validated: typed field access that records errors."""

    def __init__(self, loader: _Loader, where: str, data: Mapping[str, Any]) -> None:
        self.loader = loader
        self.where = where
        self.data = data
        self.secret_paths: set[str] = set()
        self.named = False

    def error(self, path: str, message: str) -> None:
        if path in self.secret_paths:
            return  # already refused as a secret; one message per field is enough
        self.loader.errors.append(f"{self.where} {path}: {message}")

    def secret(self, path: str, kind: str) -> None:
        self.error(path, f"looks like a secret ({kind}). Never write a secret into a manifest: put it "
                   "in an environment variable and write that variable's NAME in tokenEnv / apiKeyEnv "
                   "(or an agent's env list) instead (R28)")
        self.secret_paths.add(path)

    def fields(self, obj: Mapping[str, Any], path: str, allowed: tuple[str, ...], required: tuple[str, ...] = (),
               hint: str = "") -> bool:
        """Refuse unknown keys and report missing required ones. False on missing."""
        ok = True
        for key in obj:
            if key not in allowed:
                shown = isinstance(key, str) and _show(key) != "(value hidden)"
                where = f"{path}{'.' if path else ''}{key}" if shown else (path or "(document)")
                what = f"field {key!r}" if shown else "a field"
                self.error(where, f"unknown {what}; allowed here: {', '.join(allowed)}{hint}")
        for key in required:
            if key not in obj or obj[key] is None:
                self.error(f"{path}{'.' if path else ''}{key}", "required field is missing; add it")
                ok = False
        return ok

    # Typed getters. Each returns `default` (after recording an error) on a bad value.

    def text(self, obj: Mapping[str, Any], key: str, path: str, default: Any = None, *,
             pattern: re.Pattern[str] | None = None, what: str = "") -> Any:
        v = obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            return default
        if not isinstance(v, str) or not v.strip():
            self.error(path, "must be a non-empty text value")
            return default
        if pattern is not None and not pattern.match(v):
            self.error(path, f"{_show(v)} is not valid; {what}")
            return default
        return v

    def choice(self, obj: Mapping[str, Any], key: str, path: str, choices: tuple[str, ...],
               default: Any = None) -> Any:
        v = obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            return default
        if v not in choices:
            self.error(path, f"{_show(v)} is not one of: {', '.join(choices)}")
            return default
        return v

    def integer(self, obj: Mapping[str, Any], key: str, path: str, default: int, *, minimum: int = 0) -> int:
        v = obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            self.error(path, f"must be a whole number (>= {minimum})")
            return default
        if v < minimum:
            self.error(path, f"must be at least {minimum}")
            return default
        return v

    def number(self, obj: Mapping[str, Any], key: str, path: str, default: float, *,
               positive: bool = True) -> float:
        v = obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.error(path, "must be a number")
            return default
        if positive and v <= 0:
            self.error(path, "must be greater than 0")
            return default
        return float(v)

    def str_list(self, obj: Mapping[str, Any], key: str, path: str, *,
                 pattern: re.Pattern[str] | None = None, what: str = "",
                 choices: tuple[str, ...] | None = None, nonempty: bool = False,
                 unique: bool = True) -> tuple[str, ...]:
        """A list of non-empty strings; a set unless `unique=False` (an argv)."""
        v = obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            if nonempty:
                self.error(path, "required list is missing; add it")
            return ()
        if not isinstance(v, list):
            self.error(path, "must be a list, e.g. [a, b]")
            return ()
        if nonempty and not v:
            self.error(path, "must not be empty")
        out: list[str] = []
        for i, item in enumerate(v):
            p = f"{path}[{i}]"
            if not isinstance(item, str) or not item:
                self.error(p, "must be a non-empty text value")
                continue
            if pattern is not None and not pattern.match(item):
                self.error(p, f"{_show(item)} is not valid; {what}")
                continue
            if choices is not None and item not in choices:
                self.error(p, f"{_show(item)} is not one of: {', '.join(choices)}")
                continue
            if unique and item in out:
                self.error(p, f"{_show(item)} is listed twice; remove the duplicate")
                continue
            out.append(item)
        return tuple(out)

    def env_name(self, obj: Mapping[str, Any], key: str, path: str) -> str | None:
        return self.text(obj, key, path, None, pattern=ENV_NAME_RE,
                         what="write the NAME of an environment variable (A-Z, 0-9, _), never its value")

    def mapping(self, obj: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any] | None:
        v = obj.get(key, _MISSING)
        if v is _MISSING or v is None:
            return None
        if not isinstance(v, dict):
            self.error(path, "must be a mapping (key: value pairs)")
            return None
        return v


class _Loader:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.errors: list[str] = []
        self.workspaces: dict[str, Workspace] = {}
        self.models: dict[str, Model] = {}
        self.agents: dict[str, Agent] = {}
        self.workflows: dict[str, Workflow] = {}
        self.triggers: dict[str, Trigger] = {}
        self.seen: dict[tuple[str, str], str] = {}
        self._raw_nodes: dict[str, list] = {}

    # -- secrets ------------------------------------------------------------

    def scan_secrets(self, doc: _Doc, obj: Any, path: str) -> None:
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

    def add_named(self, doc: _Doc, kind: str, name: str) -> bool:
        prev = self.seen.get((kind, name))
        if prev is not None:
            doc.error("name", f"a {kind} named {_show(name)} is already defined at {prev}; names must be "
                      "unique per kind, rename one of them")
            return False
        self.seen[(kind, name)] = doc.where
        return True

    def load_doc(self, doc: _Doc) -> None:
        data = doc.data
        kind = data.get("kind")
        if kind is None:
            doc.error("kind", f"required field is missing; add kind: one of {', '.join(KINDS)}")
            return
        if kind not in KINDS:
            doc.error("kind", f"unknown kind {_show(kind)}; use one of {', '.join(KINDS)}")
            return
        name = doc.text(data, "name", "name", None, pattern=NAME_RE,
                        what="use 1-63 letters, digits, '.', '_' or '-'")
        if "name" not in data or data["name"] is None:
            doc.error("name", "required field is missing; add name: <a unique name>")
        elif name is not None:
            doc.named = self.add_named(doc, kind, name)
        getattr(self, f"load_{kind.lower()}")(doc, data, name)

    def load_workspace(self, doc: _Doc, d: Mapping[str, Any], name: str | None) -> None:
        doc.fields(d, "", ("kind", "name", "repo", "baseBranch", "tokenEnv", "forge", "sandbox", "author",
                           "maxRunning"), ("repo",))
        repo = self.repo(doc, d.get("repo"))
        base_branch = doc.text(d, "baseBranch", "baseBranch", "main")
        token_env = doc.env_name(d, "tokenEnv", "tokenEnv")
        forge = ForgeConfig(type="local")
        fd = doc.mapping(d, "forge", "forge")
        if fd is not None:
            doc.fields(fd, "forge", ("type", "repo", "baseUrl", "mergeMethod"), ("type",))
            ftype = doc.choice(fd, "type", "forge.type", FORGES, "local")
            frepo = doc.text(fd, "repo", "forge.repo", "", pattern=GITHUB_REPO_RE,
                             what="write the GitHub repository as owner/name")
            base_url = doc.text(fd, "baseUrl", "forge.baseUrl", "https://api.github.com")
            if "baseUrl" in fd and isinstance(fd.get("baseUrl"), str):
                self.api_url(doc, fd["baseUrl"], "forge.baseUrl")
            merge_method = doc.choice(fd, "mergeMethod", "forge.mergeMethod", MERGE_METHODS, "merge")
            if ftype == "github":
                if not frepo and "repo" not in fd:
                    doc.error("forge.repo", "required for a github forge; add repo: owner/name")
                if "tokenEnv" not in d:
                    doc.error("tokenEnv", "a github forge needs a token: add tokenEnv: <NAME of the "
                              "environment variable that holds a GitHub fine-grained token>")
            forge = ForgeConfig(type=ftype, repo=frepo or "", base_url=base_url.rstrip("/"),
                                merge_method=merge_method)
        sandbox = SandboxConfig()
        sd = doc.mapping(d, "sandbox", "sandbox")
        if sd is not None:
            doc.fields(sd, "sandbox", ("image", "limits", "egress", "egressPrivate"))
            image = doc.text(sd, "image", "sandbox.image", DEFAULT_SANDBOX_IMAGE)
            limits = Limits()
            ld = doc.mapping(sd, "limits", "sandbox.limits")
            if ld is not None:
                doc.fields(ld, "sandbox.limits", ("cpus", "memory", "pids", "disk"))
                cpus = doc.number(ld, "cpus", "sandbox.limits.cpus", limits.cpus)
                memory = limits.memory_bytes
                if ld.get("memory") is not None:
                    parsed = parse_memory(ld["memory"])
                    if parsed is None:
                        doc.error("sandbox.limits.memory", f"{_show(ld['memory'])} is not a size; write a "
                                  "number of bytes or a size such as 512m or 2g")
                    elif parsed < MIN_MEMORY:
                        doc.error("sandbox.limits.memory", "is below Docker's minimum of 6m; raise it")
                    else:
                        memory = parsed
                pids = doc.integer(ld, "pids", "sandbox.limits.pids", limits.pids, minimum=1)
                disk = limits.disk_bytes
                if "disk" in ld:
                    parsed = parse_memory(ld["disk"])
                    if parsed is None or parsed <= 0:
                        doc.error("sandbox.limits.disk", f"{_show(ld['disk'])} is not a disk size; write a "
                                  "positive size such as 512m or 10g (the workspace's disk cap)")
                    elif parsed < MIN_DISK:
                        doc.error("sandbox.limits.disk", f"{_show(ld['disk'])} is below the minimum of 16m; "
                                  "raise it")
                    elif parsed > MAX_DISK:
                        doc.error("sandbox.limits.disk", f"{_show(ld['disk'])} is above the maximum of 16t; "
                                  "lower it")
                    else:
                        disk = parsed
                limits = Limits(cpus=cpus, memory_bytes=memory, pids=pids, disk_bytes=disk)
            egress = doc.str_list(sd, "egress", "sandbox.egress", pattern=EGRESS_RE,
                                  what="write a lower-case host name such as pypi.org, or .example.com for "
                                  "a domain and its subdomains (no scheme, port, path or IP address)")
            bad_ip = []
            for host in egress:
                try:
                    ipaddress.ip_address(host.lstrip("."))
                    bad_ip.append(host)
                except ValueError:
                    pass
            for host in bad_ip:
                doc.error("sandbox.egress", f"{_show(host)} is an IP address; name a host instead")
            egress = tuple(h for h in egress if h not in bad_ip)
            sandbox = SandboxConfig(image=image, limits=limits, egress=egress,
                                    egress_private=self.egress_private(doc, sd, egress))
        author = Author()
        ad = doc.mapping(d, "author", "author")
        if ad is not None:
            doc.fields(ad, "author", ("name", "email"))
            author = Author(name=doc.text(ad, "name", "author.name", author.name),
                            email=doc.text(ad, "email", "author.email", author.email))
        max_running = doc.integer(d, "maxRunning", "maxRunning", 0, minimum=0)
        if doc.named and name is not None and repo is not None:
            self.workspaces[name] = Workspace(
                name=name, repo=repo, base_branch=base_branch, token_env=token_env, forge=forge,
                sandbox=sandbox, author=author, max_running=max_running, source=doc.where)

    def egress_private(self, doc: _Doc, sd: Mapping[str, Any], egress: tuple[str, ...]) -> tuple[str, ...]:
        """sandbox.egressPrivate: host names (each also allowed by egress) that may
        resolve to private addresses, or CIDR subnets the proxy may reach for names
        in egress; never loopback, link-local or multicast (R11)."""
        raw = doc.str_list(sd, "egressPrivate", "sandbox.egressPrivate")
        out: list[str] = []
        for i, entry in enumerate(raw):
            path = f"sandbox.egressPrivate[{i}]"
            try:
                net = ipaddress.ip_network(entry, strict=False)
            except ValueError:
                net = None
            if net is not None:
                if any(net.version == n.version and net.overlaps(n) for n in _NEVER_NETS):  # type: ignore[arg-type]
                    doc.error(path, f"{_show(entry)} overlaps loopback, link-local, multicast or reserved "
                              "addresses; list only the private subnet of the service (e.g. 10.20.0.0/16)")
                    continue
                out.append(str(net))
                continue
            if not EGRESS_RE.match(entry):
                doc.error(path, f"{_show(entry)} is neither a host name (mirror.internal, .corp.example) nor a "
                          "CIDR subnet (10.20.0.0/16)")
                continue
            bare = entry.lstrip(".")
            if not any(e == entry or (e.startswith(".") and (bare == e[1:] or bare.endswith(e))) for e in egress):
                doc.error(path, f"{_show(entry)} is not in sandbox.egress; add it there too (egressPrivate only "
                          "lets an allowed name reach a private address)")
                continue
            out.append(entry)
        if out and not egress:
            doc.error("sandbox.egressPrivate", "has no effect without sandbox.egress (no network at all); add "
                      "the names the sandbox may reach to sandbox.egress")
        return tuple(out)

    def repo(self, doc: _Doc, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            doc.error("repo", "must be an https:// URL or a local path")
            return None
        if value.startswith("file://"):
            parts = urllib.parse.urlsplit(value)
            if parts.username or parts.password or "@" in parts.netloc:
                doc.error("repo", "must not hold credentials (user@ or user:password@); remove them and name "
                          "the token's variable in tokenEnv")
                return None
            return value
        if "://" in value or re.match(r"^[\w.-]+@[\w.-]+:", value):
            parts = urllib.parse.urlsplit(value)
            if "@" in parts.netloc or re.match(r"^[\w.-]+@[\w.-]+:", value):
                doc.error("repo", "must not hold credentials (user@ or user:password@); remove them and name "
                          "the token's variable in tokenEnv")
                return None
            if parts.scheme != "https":
                doc.error("repo", "only https:// remotes are supported (or a local path / file:// URL); "
                          "rewrite the URL as https://host/owner/name.git")
                return None
            if not parts.hostname:
                doc.error("repo", "has no host; write https://host/owner/name.git")
                return None
            return value
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = self.directory / path
        return str(path.resolve())

    def api_url(self, doc: _Doc, value: str, path: str) -> None:
        parts = urllib.parse.urlsplit(value)
        if parts.username or parts.password or "@" in parts.netloc:
            doc.error(path, "must not hold credentials; remove user@/user:password@")
        elif parts.scheme == "https" and parts.hostname:
            return
        elif parts.scheme == "http" and _is_loopback(parts.hostname):
            return  # a local test or inference server on this machine
        else:
            doc.error(path, "must be an https:// URL (http:// is accepted only for localhost)")

    def load_model(self, doc: _Doc, d: Mapping[str, Any], name: str | None) -> None:
        doc.fields(d, "", ("kind", "name", "provider", "model", "baseUrl", "apiKeyEnv", "script", "maxTokens",
                           "timeout"), ("provider",))
        provider = doc.choice(d, "provider", "provider", PROVIDERS)
        model = doc.text(d, "model", "model", "")
        base_url = doc.text(d, "baseUrl", "baseUrl", DEFAULT_BASE_URLS.get(provider or "", ""))
        if isinstance(d.get("baseUrl"), str) and d["baseUrl"].strip():
            self.api_url(doc, d["baseUrl"], "baseUrl")
        api_key_env = doc.env_name(d, "apiKeyEnv", "apiKeyEnv")
        script: Path | None = None
        raw_script = doc.text(d, "script", "script", None)
        if provider == "replay":
            if "script" not in d:
                doc.error("script", "a replay model needs script: <file of scripted responses, relative to "
                          "the config folder>")
            elif raw_script is not None:
                script = Path(raw_script).expanduser()
                if not script.is_absolute():
                    script = self.directory / script
                script = script.resolve()
                if not script.is_file():
                    doc.error("script", "file not found; create it or fix the path (relative to the config "
                              "folder)")
        elif provider in ("openai", "anthropic", "gemini"):
            if "script" in d:
                doc.error("script", "only replay models take a script; remove it")
            if not model and "model" not in d:
                doc.error("model", f"required for provider {provider}; add model: <model id>")
        max_tokens = doc.integer(d, "maxTokens", "maxTokens", 4096, minimum=1)
        timeout = doc.number(d, "timeout", "timeout", 120.0)
        if doc.named and name is not None and provider is not None:
            self.models[name] = Model(name=name, provider=provider, model=model, base_url=base_url.rstrip("/"),
                                      api_key_env=api_key_env, script=script, max_tokens=max_tokens,
                                      timeout_s=timeout, source=doc.where)

    def load_agent(self, doc: _Doc, d: Mapping[str, Any], name: str | None) -> None:
        doc.fields(d, "", ("kind", "name", "type", "command", "env", "image", "model", "relayEnv", "preset",
                           "fixedEnv"), ("type",) if "preset" in d else ("type", "command"),
                   hint="" if "preset" in d else " (or preset: one of " + ", ".join(PRESETS) + ")")
        atype = doc.choice(d, "type", "type", ("acp",))
        # An argv: repeated items are meaningful (`[codex-acp, -c, a=1, -c, b=2]`).
        command = doc.str_list(d, "command", "command", nonempty="command" in d, unique=False)
        env = doc.str_list(d, "env", "env", pattern=ENV_NAME_RE,
                           what="list environment variable NAMES (A-Z, 0-9, _), never values")
        image = doc.text(d, "image", "image", None)
        model = doc.text(d, "model", "model", None, pattern=NAME_RE, what="write the name of a Model manifest")
        relay_env = self.relay_env(doc, d, env)
        if relay_env and model is None:
            doc.error("relayEnv", "only an agent with model: gets the relay's variables; add model: <Model name>")
        preset = doc.choice(d, "preset", "preset", tuple(PRESETS))
        fixed_env = self.fixed_env(doc, d, env, relay_env)
        if doc.named and name is not None and atype is not None and (command or preset is not None):
            agent = apply_preset(Agent(name=name, type=atype, command=command, env=env, image=image, model=model,
                                       relay_env=relay_env, fixed_env=fixed_env, source=doc.where), preset)
            clash = sorted(set(env) & {k for k, _ in (*agent.relay_env, *agent.fixed_env)})
            if preset is not None and clash:
                doc.error("env", f"preset {preset} sets {', '.join(clash)} itself (from the relay or as a fixed "
                          "value); remove it from env: a model key never enters the sandbox (R32)")
            self.agents[name] = agent

    def fixed_env(self, doc: _Doc, d: Mapping[str, Any], secret_names: tuple[str, ...],
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

    def relay_env(self, doc: _Doc, d: Mapping[str, Any], secret_names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
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

    def load_workflow(self, doc: _Doc, d: Mapping[str, Any], name: str | None) -> None:
        doc.fields(d, "", ("kind", "name", "workspace", "inputs", "maxTokens", "nodes"), ("nodes",))
        workspace = doc.text(d, "workspace", "workspace", None)
        inputs = doc.str_list(d, "inputs", "inputs", pattern=INPUT_RE,
                              what="use letters, digits and _, starting with a letter or _")
        max_tokens = doc.integer(d, "maxTokens", "maxTokens", 0, minimum=0)
        raw_nodes = d.get("nodes")
        nodes: list[Node] = []
        if raw_nodes is not None and not isinstance(raw_nodes, list):
            doc.error("nodes", "must be a list of nodes (- id: ...)")
        elif isinstance(raw_nodes, list):
            if not raw_nodes:
                doc.error("nodes", "must not be empty; add at least one node")
            ids: set[str] = set()
            for i, raw in enumerate(raw_nodes):
                node = self.node(doc, raw, f"nodes[{i}]")
                if node is None:
                    continue
                if node.id in ids:
                    doc.error(f"nodes[{i}].id", f"node id {_show(node.id)} is used twice; ids must be unique "
                              "within a workflow")
                    continue
                ids.add(node.id)
                nodes.append(node)
        if doc.named and name is not None and "nodes" in d:
            self.workflows[name] = Workflow(name=name, nodes=tuple(nodes), workspace=workspace, inputs=inputs,
                                            max_tokens=max_tokens, source=doc.where)
            self._raw_nodes[name] = raw_nodes if isinstance(raw_nodes, list) else []

    def node(self, doc: _Doc, raw: Any, path: str) -> Node | None:
        if not isinstance(raw, dict):
            doc.error(path, "must be a mapping with id and one of run / model / agent / uses")
            return None
        present = [k for k in ("run", "model", "agent", "uses") if k in raw]
        common = ("id", "needs", "timeout", "retries")
        per_kind = {
            "run": ("run",),
            "model": ("model", "prompt", "tools", "max_turns", "max_tokens"),
            "agent": ("agent", "prompt", "deny", "max_tokens"),
            "uses": ("uses", "with"),
        }
        if len(present) != 1:
            doc.fields(raw, path, common + tuple(k for v in per_kind.values() for k in v), ("id",))
            doc.error(path, "a node needs exactly one of run: (a command), model: (a Model name), "
                      f"agent: (an Agent name) or uses: (builtin:{'|'.join(BUILTINS)}); "
                      + ("it has none" if not present else f"it has {' and '.join(present)}"))
            return None
        which = present[0]
        doc.fields(raw, path, common + per_kind[which], ("id",),
                   hint=f" (a {which} node)")
        node_id = doc.text(raw, "id", f"{path}.id", None, pattern=NODE_ID_RE,
                           what="use letters, digits, '_' and '-'")
        needs = doc.str_list(raw, "needs", f"{path}.needs", pattern=NODE_ID_RE,
                             what="list node ids of this workflow")
        timeout = doc.number(raw, "timeout", f"{path}.timeout", 1800.0)
        retries = doc.integer(raw, "retries", f"{path}.retries", 0, minimum=0)
        kw: dict[str, Any] = {}
        if which == "run":
            kind = "run"
            kw["run"] = doc.text(raw, "run", f"{path}.run", None)
            if kw["run"] is None:
                return None
        elif which == "model":
            kind = "model"
            kw["model"] = doc.text(raw, "model", f"{path}.model", None)
            kw["prompt"] = doc.text(raw, "prompt", f"{path}.prompt", "")
            if "prompt" not in raw:
                doc.error(f"{path}.prompt", "a model node needs a prompt; add prompt: ...")
            kw["tools"] = doc.str_list(raw, "tools", f"{path}.tools", choices=NODE_TOOLS)
            kw["max_turns"] = doc.integer(raw, "max_turns", f"{path}.max_turns", 20, minimum=1)
            kw["max_tokens"] = doc.integer(raw, "max_tokens", f"{path}.max_tokens", 0, minimum=0)
        elif which == "agent":
            kind = "agent"
            kw["agent"] = doc.text(raw, "agent", f"{path}.agent", None)
            kw["prompt"] = doc.text(raw, "prompt", f"{path}.prompt", "")
            if "prompt" not in raw:
                doc.error(f"{path}.prompt", "an agent node needs a prompt; add prompt: ...")
            kw["deny"] = doc.str_list(raw, "deny", f"{path}.deny", choices=PERMISSION_KINDS)
            kw["max_tokens"] = doc.integer(raw, "max_tokens", f"{path}.max_tokens", 0, minimum=0)
        else:
            kind = "builtin"
            uses = raw.get("uses")
            builtin = uses[len("builtin:"):] if isinstance(uses, str) and uses.startswith("builtin:") else None
            if builtin not in BUILTINS:
                doc.error(f"{path}.uses", f"{_show(uses)} is not a builtin; use one of "
                          + ", ".join(f"builtin:{b}" for b in BUILTINS))
                return None
            kw["uses"] = builtin
            with_ = doc.mapping(raw, "with", f"{path}.with") or {}
            allowed = BUILTIN_WITH[builtin]
            doc.fields(with_, f"{path}.with", allowed, hint=f" (builtin:{builtin})")
            clean: dict[str, Any] = {}
            for k in allowed:
                v = doc.text(with_, k, f"{path}.with.{k}", None)
                if v is not None:
                    clean[k] = v
            if "method" in clean and clean["method"] not in MERGE_METHODS:
                doc.error(f"{path}.with.method", f"is not one of: {', '.join(MERGE_METHODS)}")
                clean.pop("method")
            kw["with_"] = clean
        if node_id is None:
            return None
        return Node(id=node_id, kind=kind, needs=needs, timeout_s=timeout, retries=retries, **kw)

    def load_trigger(self, doc: _Doc, d: Mapping[str, Any], name: str | None) -> None:
        """kind: Trigger (docs/GITHUB.md): which GitHub events start which workflow. (`when`, not
        `on`: YAML reads a bare `on` key as the boolean true.)"""
        doc.fields(d, "", ("kind", "name", "workspace", "workflow", "when", "inputs", "poll"),
                   ("workspace", "workflow", "when"))
        workspace = doc.text(d, "workspace", "workspace", None)
        workflow = doc.text(d, "workflow", "workflow", None)
        on = doc.mapping(d, "when", "when") or {}
        doc.fields(on, "when", ("labels", "assignees", "command"))
        labels = doc.str_list(on, "labels", "when.labels")
        assignees = doc.str_list(on, "assignees", "when.assignees", pattern=GITHUB_LOGIN_RE,
                                 what="write a GitHub user name (letters, digits and -)")
        command = doc.text(on, "command", "when.command", "", pattern=COMMAND_RE,
                           what="write a word that starts with /, such as /afe")
        if "when" in d and not (labels or assignees or command):
            doc.error("when", "starts nothing; add labels: [..], assignees: [..] or command: /afe")
        raw_inputs = doc.mapping(d, "inputs", "inputs") or {}
        inputs: list[tuple[str, str]] = []
        for k, v in raw_inputs.items():
            path = f"inputs.{k}"
            if not isinstance(k, str) or not INPUT_RE.match(k):
                doc.error("inputs", "a key is not an input name: use letters, digits and _")
                continue
            if v not in TRIGGER_FIELDS:
                doc.error(path, f"{_show(v)} is not one of: {', '.join(TRIGGER_FIELDS)}")
                continue
            inputs.append((k, v))
        poll = d.get("poll", False)
        if not isinstance(poll, bool):
            doc.error("poll", "must be true or false")
            poll = False
        if doc.named and name is not None and workspace and workflow:
            self.triggers[name] = Trigger(name=name, workspace=workspace, workflow=workflow, labels=labels,
                                          assignees=assignees, command=command or "", inputs=tuple(inputs),
                                          poll=poll, source=doc.where)

    # -- cross-document checks ----------------------------------------------

    def check_trigger_references(self) -> None:
        for tr in self.triggers.values():
            where = tr.source
            ws = self.workspaces.get(tr.workspace)
            if ws is None:
                self.errors.append(f"{where} workspace: no Workspace named {_show(tr.workspace)}; "
                                   f"defined: {', '.join(sorted(self.workspaces)) or 'none'}")
            elif ws.forge.type != "github":
                self.errors.append(f"{where} workspace: Workspace {_show(tr.workspace)} has a "
                                   f"{ws.forge.type} forge; a Trigger needs forge: {{type: github, repo: owner/name}}")
            wf = self.workflows.get(tr.workflow)
            if wf is None:
                self.errors.append(f"{where} workflow: no Workflow named {_show(tr.workflow)}; "
                                   f"defined: {', '.join(sorted(self.workflows)) or 'none'}")
                continue
            for k, _ in tr.inputs:
                if k not in wf.inputs:
                    self.errors.append(f"{where} inputs.{k}: Workflow {_show(wf.name)} declares no input "
                                       f"{_show(k)}; declared: {', '.join(wf.inputs) or 'none'} (add it to "
                                       "the workflow's inputs or remove it here)")

    def check_references(self) -> None:
        self.check_trigger_references()
        for wf in self.workflows.values():
            where = wf.source
            if wf.workspace is not None and ("Workspace", wf.workspace) not in self.seen:
                self.errors.append(f"{where} workspace: no Workspace named {_show(wf.workspace)}; "
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
                    self.errors.append(f"{where} {p}.model: no Model named {_show(n.model)}; "
                                       f"defined: {', '.join(sorted(self.models)) or 'none'}")
                elif n.kind == "model" and n.model in self.models and self.models[n.model].provider == "gemini":
                    self.errors.append(f"{where} {p}.model: Model {_show(n.model)} is a gemini model, which "
                                       "only agents can use (through the relay); use an openai or anthropic "
                                       "Model for a model node")
                if n.kind == "agent" and ("Agent", n.agent) not in self.seen:
                    self.errors.append(f"{where} {p}.agent: no Agent named {_show(n.agent)}; "
                                       f"defined: {', '.join(sorted(self.agents)) or 'none'}")
                for dep in n.needs:
                    if dep not in ids:
                        self.errors.append(f"{where} {p}.needs: {_show(dep)} is not a node id of this "
                                           f"workflow; ids: {', '.join(sorted(ids))}")
                    elif dep == n.id:
                        self.errors.append(f"{where} {p}.needs: a node cannot need itself")
            cycle = _find_cycle(wf.nodes)
            if cycle:
                self.errors.append(f"{where} nodes: dependency cycle {' -> '.join(cycle)}; remove one of "
                                   "these needs")

        for a in self.agents.values():
            if a.model is None:
                continue
            m = self.models.get(a.model)
            if m is None:
                if ("Model", a.model) not in self.seen:
                    self.errors.append(f"{a.source} model: no Model named {_show(a.model)}; "
                                       f"defined: {', '.join(sorted(self.models)) or 'none'}")
            elif m.provider not in RELAY_PROVIDERS:
                self.errors.append(f"{a.source} model: Model {_show(a.model)} has provider {m.provider}, which "
                                   f"has no HTTP API an agent can call; use one of: {', '.join(RELAY_PROVIDERS)}")
            elif a.preset in PRESETS and m.provider not in PRESETS[a.preset].providers:
                want = " or ".join(PRESETS[a.preset].providers)
                self.errors.append(f"{a.source} model: preset {a.preset} talks to {want} models, but Model "
                                   f"{_show(a.model)} has provider {m.provider}; name a Model of provider {want} or "
                                   "choose the preset of that provider (docs/AGENTS.md)")
            elif not a.relay_env and m.provider not in DEFAULT_RELAY_ENV:
                self.errors.append(f"{a.source} relayEnv: provider {m.provider} has no default; list the "
                                   "variables the agent reads")

    def config(self) -> Config:
        return Config(directory=self.directory, workspaces=self.workspaces, models=self.models,
                      agents=self.agents, workflows=self.workflows, triggers=self.triggers)


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
                return stack[stack.index(w):] + [w]
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
    loader = _Loader(directory)
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
    for path, _, data in parsed:
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
        doc = _Doc(loader, where, data)
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
    for a in config.agents.values():
        for n in a.env:
            wanted.append((n, f"{a.source} Agent {a.name} env"))
    return [(name, where) for name, where in wanted if not environ.get(name)]
