"""The clean-room checkout of a head for its verification (R41).

`<data>/workspaces/<ticket>-verify` is a NEW folder every time holding the
head `sha` (the pull request's head a person is asked to approve) MERGED
ONTO the base branch's current tip, as a merge queue would merge it, with
the base's version of each of `base_paths` and of the harness (harness.py:
what decides how the tests run). Built with git plumbing on a temporary
index of the ticket's private git dir, never a work tree the sandbox wrote:

    merge-tree --write-tree <base> <sha>  # the merge result (conflicts: nothing is checked out)
    ls-tree -r <base> / <merged>          # what the base and the merge hold
    read-tree <merged>                    # into a temporary index, then
    update-index -z --index-info          # base paths and harness from the base, bytecode and
                                          # shadowing top-level names out, test sections merged
    write-tree; commit-tree -p <base> -p <sha>

then checked out like a ticket's workspace (checkout.populate; the base's
`.gitattributes`, never the head's, decide how files are written) and handed
to the sandbox user. The base is the base branch's tip in the mirror,
fetched now. A `sha` the ticket's git dir does not know (a person pushed to
the branch) is fetched into the mirror, whose objects the git dir borrows.
"""

from __future__ import annotations

import asyncio
import logging
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from services.common.config.model import Workspace
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.host.gitcmd import GitResult
from services.common.layout import verify_id
from services.common.provenance.bytecode import allowed_by, loaded_in_place_of_source
from services.common.schema.verify import MAX_BASE_PATHS, base_path_problem
from services.credentials.verification import harness
from services.credentials.workspaces.continuation import author_env
from services.credentials.workspaces.host import _remove_workspace

if TYPE_CHECKING:
    from services.credentials.workspaces.host import WorkspaceGit

log = logging.getLogger(__name__)

SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_LITERAL = {"GIT_LITERAL_PATHSPECS": "1"}   # a path is a path, never a glob or a magic pathspec
_PYTHON_BYTECODE = (".pyc", ".pyo")
MAX_LISTED = 200                            # paths of one kind in a verification's answer
MAX_SECTION_BYTES = 1024 * 1024             # a bigger pyproject.toml/setup.cfg/package.json: the base's whole
_GONE = ""                                  # an edit that removes the path
_PLAIN = ("100644", "100755")               # a regular file's modes (not a symbolic link or a submodule)


@dataclass(frozen=True)
class Verification:
    sha: str          # the head
    base_sha: str     # the base branch's tip the head was merged onto ("" when it has none)
    tree: str         # the tree checked out
    commit: str       # the commit checked out
    workspace_ticket: str
    harness_changes: list[str] = field(default_factory=list)
    binary_files: list[str] = field(default_factory=list)
    shadowing: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)   # not empty: nothing was checked out


@dataclass(frozen=True)
class _Entry:
    mode: str
    kind: str
    oid: str

    def line(self, path: str) -> bytes:
        return f"{self.mode} {self.kind} {self.oid}\t".encode() + path.encode("utf-8", "surrogateescape") + b"\0"


def check_base_paths(paths: list[str] | tuple[str, ...]) -> list[str]:
    """Relative paths inside the repository, normalised ("tests/" -> "tests");
    refused: empty, absolute, `..`, `.git`, glob characters, control characters."""
    if len(paths) > MAX_BASE_PATHS:
        raise InvalidArgument(f"at most {MAX_BASE_PATHS} base paths; list fewer, wider folders")
    out: list[str] = []
    for raw in paths:
        problem = base_path_problem(raw)
        if problem:
            raise InvalidArgument(f"base path {raw[:200]!r} {problem}")
        p = str(PurePosixPath(raw))
        if p not in out:
            out.append(p)
    return out


async def prepare(wg: WorkspaceGit, ws: Workspace, ticket_id: str, sha: str,
                  base_paths: list[str], into: Path | None = None,
                  commands: list[str] | None = None) -> Verification:
    """The checkout at <data>/workspaces/<ticket>-verify, or with `into` (a new folder,
    private to this broker) there instead, for a sandbox broker on another host."""
    sha = (sha or "").lower()
    if not SHA_RE.match(sha):
        raise InvalidArgument("sha must be a full commit SHA (40 hex digits)")
    paths = check_base_paths(base_paths)
    commands = list(commands or [])
    vid = verify_id(ticket_id)
    target = into or wg.layout.workspace(vid)   # checks the id (at most 63 characters)
    gitdir = wg._ticket_gitdir(ticket_id)
    async with wg._lock("ticket:" + ticket_id):
        # the base's tip and any commit a person pushed to the branch
        mirror = await wg.mirrors.update(ws)
        if await wg._rev(gitdir, sha + "^{commit}") is None:
            raise NotFound(f"commit {sha[:12]} is in neither the ticket's git dir nor the repository "
                           f"of workspace {ws.name!r}; push it to the pull request's branch")
        base = await wg._rev(mirror, f"refs/heads/{ws.base_branch}") or ""
        if paths and not base:
            raise FailedPrecondition(f"workspace {ws.name!r}: base branch {ws.base_branch!r} is missing in its "
                                     "repository; fix base_branch or push the branch")
        room = _CleanRoom(wg, ws, gitdir, sha, base, paths, commands)
        conflicts = await room.merge()
        if conflicts:
            log.info("ticket %s: %s does not merge onto %s (%d conflicting paths)", ticket_id, sha[:12],
                     base[:12], len(conflicts))
            return Verification(sha, base, "", "", vid, conflicts=conflicts[:MAX_LISTED])
        commit = await room.commit()
        tree = await wg._rev(gitdir, commit + "^{tree}") or ""
        if into is None:
            await asyncio.to_thread(_clear, target)
            wg.layout.workspaces_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
        await wg._populate(gitdir, target, commit, gitdir / "afe-verify-checkout.index")
    log.info("ticket %s: verification checkout of %s onto %s (%s from the base; harness changes: %s)", ticket_id,
             sha[:12], base[:12] or "-", ", ".join(paths) or "no base paths",
             len(room.harness_changes))
    return Verification(sha, base, tree, commit, vid, room.harness_changes[:MAX_LISTED],
                        room.binary_files[:MAX_LISTED], room.shadowing[:MAX_LISTED])


class _CleanRoom:
    """The tree of one verification: the merge of head and base, then the base's
    base paths and harness, without bytecode and shadowing names."""

    def __init__(self, wg: WorkspaceGit, ws: Workspace, gitdir: Path, sha: str, base: str,
                 paths: list[str], commands: list[str]) -> None:
        self.wg, self.ws, self.gitdir, self.sha, self.base = wg, ws, gitdir, sha, base
        self.paths, self.commands = paths, commands
        self.merged_tree = ""
        self.harness_changes: list[str] = []
        self.binary_files: list[str] = []
        self.shadowing: list[str] = []

    async def _git(self, args: list[str], *, what: str, stdin: bytes | None = None,
                   env: dict[str, str] | None = None, check: bool = True) -> GitResult:
        return await self.wg.git.run(args, git_dir=self.gitdir, env={**_LITERAL, **(env or {})}, stdin=stdin,
                                     what=what, check=check)

    async def merge(self) -> list[str]:
        """The merge result's tree (self.merged_tree); the conflicting paths when there is none."""
        if not self.base:
            self.merged_tree = (await self._git(["rev-parse", "--verify", "--end-of-options", self.sha + "^{tree}"],
                                                what="git rev-parse")).out.strip()
            return []
        res = await self._git(["merge-tree", "--write-tree", "--no-messages", "--name-only", "-z",
                               "--end-of-options", self.base, self.sha], what="git merge-tree", check=False)
        parts = [p for p in res.stdout.split(b"\0") if p]
        if res.returncode == 0 and parts:
            self.merged_tree = parts[0].decode().strip()
            return []
        if res.returncode == 1 and parts:
            return sorted({p.decode("utf-8", "replace") for p in parts[1:]})
        raise FailedPrecondition(f"git merge-tree of {self.sha[:12]} onto {self.ws.base_branch} failed: "
                                 f"{res.err.strip()[-300:] or 'exit ' + str(res.returncode)}")

    async def _entries(self, treeish: str) -> dict[str, _Entry]:
        res = await self._git(["ls-tree", "-r", "-z", "--full-tree", "--end-of-options", treeish],
                              what="git ls-tree")
        out: dict[str, _Entry] = {}
        for rec in res.stdout.split(b"\0"):
            if b"\t" not in rec:
                continue
            meta, path = rec.split(b"\t", 1)
            mode, kind, oid = meta.decode().split(" ")
            out[path.decode("utf-8", "surrogateescape")] = _Entry(mode, kind, oid)
        return out

    async def commit(self) -> str:
        """The commit whose tree is checked out (a child of the base and the head)."""
        merged = await self._entries(self.merged_tree)
        base = await self._entries(self.base) if self.base else {}
        edits: dict[str, _Entry | str] = {}
        for p in self.paths:
            if not any(_under(q, p) for q in base):
                raise FailedPrecondition(
                    f"verify.base_paths: {p!r} is not in {self.ws.base_branch} at {self.base[:12]}; name a "
                    f"folder or file the base branch has (its tests, e.g. tests/), or remove it")
        in_base_paths = [q for q in set(merged) | set(base) if any(_under(q, p) for p in self.paths)]
        for q in in_base_paths:
            edits[q] = base.get(q) or _GONE
        await self._harness(merged, base, edits)
        self._shadowing(merged, base, edits)
        self._bytecode(merged, base, edits)
        await self._binary(base)
        tree = await self._write(edits)
        msg = (f"afe verification of {self.sha}\n\n"
               f"merged onto {self.ws.base_branch} at {self.base or '-'}; from the base: "
               f"{', '.join(self.paths) or 'no base paths'} and the harness\n").encode()
        parents = ["-p", self.base, "-p", self.sha] if self.base else ["-p", self.sha]
        res = await self.wg.git.run(["commit-tree", *parents, "-F", "-", tree], git_dir=self.gitdir,
                                    env=author_env(self.ws), stdin=msg, what="git commit-tree")
        return res.out.strip()

    async def _harness(self, merged: dict[str, _Entry], base: dict[str, _Entry],
                       edits: dict[str, _Entry | str]) -> None:
        extra = tuple(getattr(self.ws, "verify_harness", ()) or ())
        named = set(harness.command_paths(self.commands, set(merged) | set(base)))
        changes: set[str] = set()
        shared: list[str] = []                    # pyproject.toml, setup.cfg, package.json (any depth) changed
        for q in set(merged) | set(base):
            if q in edits or merged.get(q) == base.get(q):
                continue
            if q in named or harness.is_whole_file(q, extra):
                changes.add(q)
                edits[q] = base.get(q) or _GONE
            elif harness.section_file(q):
                shared.append(q)
        await self._sections(sorted(shared), merged, base, edits, changes)
        self.harness_changes = sorted(changes)

    async def _sections(self, names: list[str], merged: dict[str, _Entry], base: dict[str, _Entry],
                        edits: dict[str, _Entry | str], changes: set[str]) -> None:
        """The shared files the head changed, with the base's test sections (harness.merge_sections);
        read and written in one git call each, however many a monorepo (or a hostile head) has."""
        contents = await self._blobs([e for q in names for e in (merged.get(q), base.get(q)) if e is not None])
        written: dict[str, bytes] = {}
        for name in names:
            m, b = merged.get(name), base.get(name)
            sm = None                 # a symbolic link (to a file that is no harness), too big: the base's whole file
            if all(e is None or (e.mode in _PLAIN and e.oid in contents) for e in (m, b)):
                sm = harness.merge_sections(harness.section_file(name), contents[b.oid] if b else None,
                                            contents[m.oid] if m else b"")
            if sm is None:
                changes.add(name)
                edits[name] = b or _GONE
            elif sm.changed:
                changes.add(name)
                written[name] = sm.content
        for name, oid in zip(written, await self._hash(list(written.values())), strict=True):
            m, b = merged.get(name), base.get(name)
            edits[name] = _Entry(m.mode if m is not None else b.mode if b is not None else "100644", "blob", oid)

    async def _blobs(self, entries: list[_Entry]) -> dict[str, bytes]:
        """The contents of these blobs (by object id), those of at most MAX_SECTION_BYTES each."""
        oids = sorted({e.oid for e in entries if e.kind == "blob"})
        if not oids:
            return {}
        stdin = ("\n".join(oids) + "\n").encode()
        sizes = (await self._git(["cat-file", "--batch-check=%(objectname) %(objectsize)"], stdin=stdin,
                                 what="git cat-file")).out.split()
        small = [o for o, n in zip(sizes[0::2], sizes[1::2], strict=True) if int(n) <= MAX_SECTION_BYTES]
        if not small:
            return {}
        data = (await self._git(["cat-file", "--batch"], stdin=("\n".join(small) + "\n").encode(),
                                what="git cat-file")).stdout
        out: dict[str, bytes] = {}
        pos = 0
        for oid in small:                     # "<oid> blob <size>\n<content>\n" each
            eol = data.index(b"\n", pos)
            size = int(data[pos:eol].split(b" ")[2])
            out[oid] = data[eol + 1:eol + 1 + size]
            pos = eol + 1 + size + 1
        return out

    async def _hash(self, contents: list[bytes]) -> list[str]:
        """Write these blobs into the git dir (one `hash-object --stdin-paths`); their ids, in order."""
        if not contents:
            return []
        with tempfile.TemporaryDirectory(dir=self.gitdir, prefix="afe-sections-") as tmp:
            paths = []
            for i, content in enumerate(contents):
                path = Path(tmp) / str(i)
                path.write_bytes(content)
                paths.append(str(path))
            res = await self._git(["hash-object", "-w", "--no-filters", "--stdin-paths"],
                                  stdin=("\n".join(paths) + "\n").encode(), what="git hash-object")
        oids = res.out.split()
        if len(oids) != len(contents):
            raise FailedPrecondition(f"git hash-object wrote {len(oids)} of {len(contents)} files")
        return oids

    def _shadowing(self, merged: dict[str, _Entry], base: dict[str, _Entry],
                   edits: dict[str, _Entry | str]) -> None:
        def tops(entries: dict[str, _Entry]) -> set[str]:
            return {q.split("/", 1)[0] + ("/" if "/" in q else "") for q in entries}
        added = tops(merged) - tops(base)
        packages = {q.split("/", 1)[0] + "/" for q in merged
                    if q.count("/") == 1 and q.split("/", 1)[1].startswith("__init__.")}
        self.shadowing = harness.shadowing_names(added, self.commands, packages)
        out = set(self.shadowing)
        for q in merged:
            top = q.split("/", 1)[0]
            if top in out or top + "/" in out:
                edits[q] = _GONE

    def _bytecode(self, merged: dict[str, _Entry], base: dict[str, _Entry],
                  edits: dict[str, _Entry | str]) -> None:
        """Python bytecode never enters the clean room (a stale .pyc would be imported in place of
        the source); other compiled files only as the base has them or the Workspace allows."""
        allow = tuple(getattr(self.ws, "allow_compiled_paths", ()) or ())
        for q, entry in merged.items():
            if q in edits or not loaded_in_place_of_source(q):
                continue
            python = "__pycache__" in q.split("/")[:-1] or q.lower().endswith(_PYTHON_BYTECODE)
            if not python and allowed_by(q, allow):   # allowCompiledPaths never lets bytecode in
                continue
            was = base.get(q)
            if python or was != entry:
                edits[q] = was if was is not None and not python else _GONE
                if was != entry:
                    self.binary_files.append(q)

    async def _binary(self, base: dict[str, _Entry]) -> None:
        """Binary files the head adds or changes (by git's own judgement), for the reviewer."""
        if not self.base:
            return
        res = await self._git(["diff", "--numstat", "-z", "--no-renames", "--no-ext-diff", "--no-textconv",
                               self.base, self.merged_tree, "--"], what="git diff")
        for rec in res.stdout.split(b"\0"):
            if rec.startswith(b"-\t-\t"):
                q = rec[4:].decode("utf-8", "replace")
                if q not in self.binary_files:
                    self.binary_files.append(q)
        self.binary_files.sort()

    async def _write(self, edits: dict[str, _Entry | str]) -> str:
        index = self.gitdir / "afe-verify.index"
        env = {"GIT_INDEX_FILE": str(index)}
        try:
            await self._git(["read-tree", "--end-of-options", self.merged_tree], env=env, what="git read-tree")
            info = b"".join(
                (e.line(q) if isinstance(e, _Entry)
                 else b"0 " + b"0" * 40 + b"\t" + q.encode("utf-8", "surrogateescape") + b"\0")
                for q, e in sorted(edits.items()))
            if info:
                await self._git(["update-index", "-z", "--index-info"], env=env, stdin=info,
                                what="git update-index")
            return (await self._git(["write-tree"], env=env, what="git write-tree")).out.strip()
        finally:
            index.unlink(missing_ok=True)


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top + "/")


def _clear(target: Path) -> None:
    if target.exists() or target.is_symlink():
        _remove_workspace(target)
    if target.exists() or target.is_symlink():
        raise FailedPrecondition(f"the old verification folder {target.name} is still mounted; remove its "
                                 "sandbox (DestroySandbox) first")


async def release(wg: WorkspaceGit, ticket_id: str) -> None:
    """Remove the verification folder (nothing when there is none)."""
    await asyncio.to_thread(_remove_only, wg.layout.workspace(verify_id(ticket_id)))


def _remove_only(target: Path) -> None:
    if target.exists() or target.is_symlink():
        _remove_workspace(target)
