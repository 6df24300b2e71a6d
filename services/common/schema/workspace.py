"""kind: Workspace — a repository, its forge (and the fork it pushes to), the
sandbox its tickets run in (image, limits, egress, egressPrivate), the commit
author and the paths where commits may add compiled files.

`WorkspaceManifest` declares the fields (their names, types and defaults:
the JSON Schema of `afe check --schema` and the keys `load` allows);
`load` checks one document and adds a `config.Workspace`."""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.common.config.egress_rules import PRESETS, RULES_MAX, EgressRule, overlap_problems, parse_entry
from services.common.config.model import (
    DEFAULT_SANDBOX_IMAGE,
    Author,
    ForgeConfig,
    Limits,
    SandboxConfig,
    Workspace,
)
from services.common.provenance.bytecode import check_allow_pattern

from .document import Doc, check_api_url
from .text import EGRESS_RE, ENV_NAME_RE, GITHUB_REPO_RE, NAME_RE, fields_of, parse_memory, show
from .verify import harness_pattern_problem

if TYPE_CHECKING:
    from .collected import Collected as Loader

FORGES = ("github", "local")
MERGE_METHODS = ("merge", "squash", "rebase")
MIN_MEMORY = 6 * 1024 * 1024   # Docker's own minimum
MIN_DISK = 16 * 1024 * 1024    # smallest workspace disk cap (R34): a filesystem and a checkout must fit
MAX_DISK = 16 * 1024 ** 4
RUNTIMES = ("runc", "gvisor")   # sandbox.runtime
MAX_POOL = 16                  # warm sandboxes per profile of a workspace (sandbox.pool)
# Never allowed by sandbox.egressPrivate (mirrors services/sandbox/egress/allowlist.py NEVER_RANGES).
_NEVER_NETS = tuple(ipaddress.ip_network(r) for r in (
    "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4",
    "::/128", "::1/128", "::ffff:0:0/96", "fe80::/10", "ff00::/8"))

_STRICT = ConfigDict(extra="forbid", populate_by_name=True)
EnvName = Annotated[str, StringConstraints(pattern=ENV_NAME_RE.pattern)]
Size = int | Annotated[str, StringConstraints(pattern=r"^\s*\d+(\.\d+)?\s*[kmgtKMGT]?([iI]?[bB])?\s*$")]


class ForgeManifest(BaseModel):
    model_config = _STRICT
    type: Literal["github", "local"]
    repo: Annotated[str, StringConstraints(pattern=GITHUB_REPO_RE.pattern)] | None = Field(
        None, description="github: the repository as owner/name")
    baseUrl: str = Field("https://api.github.com", description="the forge API (https://, or http://localhost)")
    mergeMethod: Literal["merge", "squash", "rebase"] = "merge"
    pushRepo: Annotated[str, StringConstraints(pattern=GITHUB_REPO_RE.pattern)] | None = Field(
        None, description="github: a fork (owner/name) the ticket's branch is pushed to; the pull request is "
        "opened from it, so the base repository's CI runs it as a fork PR, without the repository's secrets "
        "(docs/GITHUB.md). Reached on the host of repo with the same token")


class LimitsManifest(BaseModel):
    model_config = _STRICT
    cpus: float = Field(1.0, gt=0)
    memory: Size = Field("1g", description="bytes, or a size such as 512m or 2g (at least 6m)")
    pids: int = Field(256, ge=1)
    disk: Size = Field("10g", description="the workspace's disk cap, 16m to 16t (R34)")


class EgressRuleManifest(BaseModel):
    """A host of sandbox.egress bound to methods and paths (R44)."""
    model_config = _STRICT
    host: Annotated[str, StringConstraints(pattern=EGRESS_RE.pattern)]
    preset: Literal["read-only", "git-fetch"] | None = Field(
        None, description="; ".join(f"{p.name}: {p.summary}" for p in PRESETS.values()))
    methods: list[Annotated[str, StringConstraints(pattern=r"^[A-Z][A-Z0-9-]{0,31}$")]] | None = Field(
        None, description="the HTTP methods allowed (capitals); left out: any method")
    paths: list[str] | None = Field(
        None, description="path patterns allowed, decoded: * within a segment, ** any segments, "
        "?name=value required query parameters; left out: any path")
    pathCase: Literal["sensitive", "insensitive"] = Field(
        "sensitive", description="insensitive for a host that treats paths case-insensitively")


class SandboxManifest(BaseModel):
    model_config = _STRICT
    image: str = DEFAULT_SANDBOX_IMAGE
    limits: LimitsManifest | None = None
    egress: list[Annotated[str, StringConstraints(pattern=EGRESS_RE.pattern)] | EgressRuleManifest] = Field(
        default_factory=list, description="host names the sandbox may reach through the proxy; empty = no "
        "network (R10). .example.com allows a domain and its subdomains. An entry {host, preset} or {host, "
        "methods, paths} allows only those requests on that host, judged on the decrypted request (R44)")
    egressPrivate: list[str] = Field(
        default_factory=list, description="names (also in egress) allowed to resolve to private addresses, "
        "or private CIDR subnets (R11)")
    pool: int = Field(0, ge=0, le=MAX_POOL, description="warm sandboxes kept ready for this workspace's "
                      "tickets, per sandbox profile (0 = none); `afe up --sandbox-pool-max` caps the total")
    runtime: Literal["runc", "gvisor"] = Field(
        "runc", description="the container runtime: runc (the host's kernel, namespaces and seccomp) or gvisor "
        "(runsc, a user-space kernel between the sandbox and the host; the engine must have it registered)")


class AuthorManifest(BaseModel):
    model_config = _STRICT
    name: str = "afe"
    email: str = "afe@localhost"


class WorkspaceManifest(BaseModel):
    """A repository tickets change, its forge and its sandbox."""
    model_config = _STRICT
    kind: Literal["Workspace"]
    name: Annotated[str, StringConstraints(pattern=NAME_RE.pattern)]
    repo: str = Field(description="an https:// URL, a local path or a file:// URL; never with user@")
    baseBranch: str = "main"
    tokenEnv: EnvName | None = Field(None, description="the NAME of the variable holding the forge token (R28)")
    forge: ForgeManifest | None = None
    sandbox: SandboxManifest | None = None
    author: AuthorManifest | None = None
    maxRunning: int = Field(0, ge=0, description="tickets running at once here; 0 = only the global limit")
    allowCompiledPaths: list[str] = Field(
        default_factory=list, description="where builtin:commit may add or change files a runtime loads in "
        "place of source (__pycache__/, *.pyc, *.so, *.class, ...; refused elsewhere): paths, folders ending "
        "in / or globs, relative to the repository root")
    verifyHarness: list[str] = Field(
        default_factory=list, description="more files that decide how verify: commands run (R41), taken from "
        "the base branch in the clean room and shown when a head changes them: paths, folders ending in / or "
        "globs, relative to the repository root (conftest.py, test-runner configs and the scripts the commands "
        "name are known already)")


def load(loader: Loader, doc: Doc, d: Mapping[str, Any], name: str | None) -> None:
    doc.fields(d, "", fields_of(WorkspaceManifest), ("repo",))
    repo = _repo(loader, doc, d.get("repo"))
    base_branch = doc.text(d, "baseBranch", "baseBranch", "main")
    token_env = doc.env_name(d, "tokenEnv", "tokenEnv")
    forge = ForgeConfig(type="local")
    fd = doc.mapping(d, "forge", "forge")
    if fd is not None:
        doc.fields(fd, "forge", fields_of(ForgeManifest), ("type",))
        ftype = doc.choice(fd, "type", "forge.type", FORGES, "local")
        frepo = doc.text(fd, "repo", "forge.repo", "", pattern=GITHUB_REPO_RE,
                         what="write the GitHub repository as owner/name")
        base_url = doc.text(fd, "baseUrl", "forge.baseUrl", "https://api.github.com")
        if "baseUrl" in fd and isinstance(fd.get("baseUrl"), str):
            check_api_url(doc, fd["baseUrl"], "forge.baseUrl")
        merge_method = doc.choice(fd, "mergeMethod", "forge.mergeMethod", MERGE_METHODS, "merge")
        push_repo = doc.text(fd, "pushRepo", "forge.pushRepo", "", pattern=GITHUB_REPO_RE,
                             what="write the fork as owner/name, e.g. pushRepo: afe-bot/widgets")
        if push_repo:
            _check_push_repo(doc, ftype, frepo or "", push_repo, repo)
        if ftype == "github":
            if not frepo and "repo" not in fd:
                doc.error("forge.repo", "required for a github forge; add repo: owner/name")
            if "tokenEnv" not in d:
                doc.error("tokenEnv", "a github forge needs a token: add tokenEnv: <NAME of the "
                          "environment variable that holds a GitHub fine-grained token>")
        forge = ForgeConfig(type=ftype, repo=frepo or "", base_url=base_url.rstrip("/"),
                            merge_method=merge_method, push_repo=push_repo or "")
    sandbox = SandboxConfig()
    sd = doc.mapping(d, "sandbox", "sandbox")
    if sd is not None:
        doc.fields(sd, "sandbox", fields_of(SandboxManifest))
        image = doc.text(sd, "image", "sandbox.image", DEFAULT_SANDBOX_IMAGE)
        limits = Limits()
        ld = doc.mapping(sd, "limits", "sandbox.limits")
        if ld is not None:
            doc.fields(ld, "sandbox.limits", fields_of(LimitsManifest))
            cpus = doc.number(ld, "cpus", "sandbox.limits.cpus", limits.cpus)
            memory = limits.memory_bytes
            if ld.get("memory") is not None:
                parsed = parse_memory(ld["memory"])
                if parsed is None:
                    doc.error("sandbox.limits.memory", f"{show(ld['memory'])} is not a size; write a "
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
                    doc.error("sandbox.limits.disk", f"{show(ld['disk'])} is not a disk size; write a "
                              "positive size such as 512m or 10g (the workspace's disk cap)")
                elif parsed < MIN_DISK:
                    doc.error("sandbox.limits.disk", f"{show(ld['disk'])} is below the minimum of 16m; "
                              "raise it")
                elif parsed > MAX_DISK:
                    doc.error("sandbox.limits.disk", f"{show(ld['disk'])} is above the maximum of 16t; "
                              "lower it")
                else:
                    disk = parsed
            limits = Limits(cpus=cpus, memory_bytes=memory, pids=pids, disk_bytes=disk)
        egress, egress_rules = _egress(doc, sd)
        pool = doc.integer(sd, "pool", "sandbox.pool", 0, minimum=0)
        if pool > MAX_POOL:
            doc.error("sandbox.pool", f"{pool} is above the maximum of {MAX_POOL}; lower it")
            pool = 0
        runtime = doc.choice(sd, "runtime", "sandbox.runtime", RUNTIMES, "runc")
        sandbox = SandboxConfig(image=image, limits=limits, egress=egress,
                                egress_private=_egress_private(loader, doc, sd, egress), pool=pool,
                                runtime=runtime, egress_rules=egress_rules)
    author = Author()
    ad = doc.mapping(d, "author", "author")
    if ad is not None:
        doc.fields(ad, "author", fields_of(AuthorManifest))
        author = Author(name=doc.text(ad, "name", "author.name", author.name),
                        email=doc.text(ad, "email", "author.email", author.email))
    max_running = doc.integer(d, "maxRunning", "maxRunning", 0, minimum=0)
    allow_compiled = doc.str_list(d, "allowCompiledPaths", "allowCompiledPaths")
    for i, pattern in enumerate(allow_compiled):
        problem = check_allow_pattern(pattern)
        if problem:
            doc.error(f"allowCompiledPaths[{i}]", f"{show(pattern)} {problem}")
    harness = doc.str_list(d, "verifyHarness", "verifyHarness")
    for i, pattern in enumerate(harness):
        problem = harness_pattern_problem(pattern)
        if problem:
            doc.error(f"verifyHarness[{i}]", f"{show(pattern)} {problem}")
    if doc.named and name is not None and repo is not None:
        loader.workspaces[name] = Workspace(
            name=name, repo=repo, base_branch=base_branch, token_env=token_env, forge=forge,
            sandbox=sandbox, author=author, max_running=max_running,
            allow_compiled_paths=allow_compiled, verify_harness=tuple(harness), source=doc.where)


def push_url(repo_url: str, push_repo: str) -> str | None:
    """The clone URL of the fork `push_repo` (owner/name) beside the repository at
    `repo_url`: the same https host and path prefix, its last two names replaced
    (https://github.com/acme/widgets.git -> https://github.com/afe-bot/widgets.git).
    None when `repo_url` is not an https URL ending in owner/name."""
    parts = urllib.parse.urlsplit(repo_url)
    names = parts.path.rstrip("/").split("/")
    if parts.scheme != "https" or not parts.netloc or len(names) < 3 or not all(names[-2:]):
        return None
    suffix = ".git" if names[-1].endswith(".git") else ""
    path = "/".join([*names[:-2], *push_repo.split("/")]) + suffix
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _check_push_repo(doc: Doc, ftype: str, frepo: str, push_repo: str, repo: str | None) -> None:
    """forge.pushRepo: a github forge's fork, other than forge.repo, on the host of an https repo."""
    if ftype != "github":
        doc.error("forge.pushRepo", "is for a github forge only (a fork on GitHub); remove it, or set "
                  "forge.type: github")
        return
    if frepo and push_repo.lower() == frepo.lower():
        doc.error("forge.pushRepo", f"names forge.repo itself ({show(frepo)}); name the fork the branch is "
                  "pushed to (owner/name of your fork), or remove pushRepo to push to the repository")
        return
    if repo is not None and push_url(repo, push_repo) is None:
        doc.error("forge.pushRepo", "needs repo to be an https:// URL ending in owner/name (the fork is "
                  "reached on the same host, e.g. https://github.com/" + push_repo + ".git); write repo "
                  "that way")


def _egress(doc: Doc, sd: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[EgressRule, ...]]:
    """sandbox.egress: host names (the whole host, CONNECT pass-through) and
    mappings binding a host to methods and paths or a preset (R44,
    egress_rules.py). Returns every host name and the rules."""
    raw = sd.get("egress")
    if raw is None:
        return (), ()
    if not isinstance(raw, list):
        doc.error("sandbox.egress", "must be a list of host names or {host, preset | methods, paths} mappings")
        return (), ()
    hosts: list[str] = []
    plain: list[str] = []
    rules: list[EgressRule] = []
    for i, item in enumerate(raw):
        path = f"sandbox.egress[{i}]"
        if isinstance(item, dict):
            host, got, problems = parse_entry(item, path)
            for where, message in problems:
                doc.error(where, message)
            if host is not None and not problems:
                rules.extend(got)
                if host not in hosts:
                    hosts.append(host)
            continue
        if not isinstance(item, str) or not EGRESS_RE.match(item):
            doc.error(path, f"{show(item)} is not valid; write a lower-case host name such as pypi.org, or "
                      ".example.com for a domain and its subdomains (no scheme, port, path or IP address), or "
                      "a mapping {host: NAME, preset: read-only} (egress rules, docs/GUIDE.md)")
            continue
        try:
            ipaddress.ip_address(item.lstrip("."))
            doc.error("sandbox.egress", f"{show(item)} is an IP address; name a host instead")
            continue
        except ValueError:
            pass
        if item in plain:
            doc.error(path, f"{show(item)} is listed twice; remove the duplicate")
            continue
        plain.append(item)
        if item not in hosts:
            hosts.append(item)
    for problem in overlap_problems(plain, [r.host for r in rules]):
        doc.error("sandbox.egress", problem)
    if len(rules) > RULES_MAX:
        doc.error("sandbox.egress", f"has {len(rules)} rules; at most {RULES_MAX}")
    return tuple(hosts), tuple(rules)


def _egress_private(loader: Loader, doc: Doc, sd: Mapping[str, Any], egress: tuple[str, ...]) -> tuple[str, ...]:
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
            if any(net.version == n.version and net.overlaps(n) for n in _NEVER_NETS):
                doc.error(path, f"{show(entry)} overlaps loopback, link-local, multicast or reserved "
                          "addresses; list only the private subnet of the service (e.g. 10.20.0.0/16)")
                continue
            out.append(str(net))
            continue
        if not EGRESS_RE.match(entry):
            doc.error(path, f"{show(entry)} is neither a host name (mirror.internal, .corp.example) nor a "
                      "CIDR subnet (10.20.0.0/16)")
            continue
        bare = entry.lstrip(".")
        if not any(e == entry or (e.startswith(".") and (bare == e[1:] or bare.endswith(e))) for e in egress):
            doc.error(path, f"{show(entry)} is not in sandbox.egress; add it there too (egressPrivate only "
                      "lets an allowed name reach a private address)")
            continue
        out.append(entry)
    if out and not egress:
        doc.error("sandbox.egressPrivate", "has no effect without sandbox.egress (no network at all); add "
                  "the names the sandbox may reach to sandbox.egress")
    return tuple(out)


def _repo(loader: Loader, doc: Doc, value: Any) -> str | None:
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
        path = loader.directory / path
    return str(path.resolve())

