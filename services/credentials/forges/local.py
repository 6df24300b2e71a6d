"""The `local` forge: the Workspace's repo is a repository on disk that acts
as the remote — bare, or a working repository (its `.git` folder holds the
branches; see `git_dir`). In a working repository whose checked-out branch
is the base branch, a merge also updates that checkout (fast-forward, only
when it has no uncommitted changes), so the files you see match the branch. A pull request is a JSON record under
`Layout.forges_dir` plus the pushed branch; merging is a real git merge into
the base branch (`merge-tree --write-tree`, `commit-tree`, `update-ref` with
the old value, so a concurrent update is never overwritten)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path
from typing import NotRequired, TypedDict

from services.common.config.model import Workspace
from services.common.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound
from services.common.host.gitcmd import GitRunner
from services.common.host.gitrepo import git_dir
from services.credentials.forges.base import Forge, PullRequestInfo


class _Comment(TypedDict):
    body: str
    at_ms: int


class _Merging(TypedDict):
    sha: str            # the approved head being merged
    merge_sha: str      # its merge commit, written before the base branch moves


class _Record(TypedDict):
    """A pull request's record: the JSON object saved under the forge's folder."""
    number: int
    head: str
    base: str
    title: str
    body: str
    state: str          # "open" or "merged"
    created_ms: int
    comments: list[_Comment]
    merging: NotRequired[_Merging]
    merge_sha: NotRequired[str]
    merged_head: NotRequired[str]
    merged_ms: NotRequired[int]


class LocalForge(Forge):
    def __init__(self, runner: GitRunner, forges_dir: Path, config_dir: Path | None = None) -> None:
        self.git = runner
        self.forges_dir = forges_dir
        self.config_dir = config_dir
        self._lock = asyncio.Lock()

    def _repo(self, ws: Workspace) -> Path:
        repo = ws.repo.strip()
        if repo.startswith("https://") or ("://" in repo and not repo.startswith("file://")):
            raise InvalidArgument(f"workspace {ws.name!r}: the local forge needs a repository on this machine "
                                  "as repo (a path); use forge type github for a remote repository")
        path = Path(repo.removeprefix("file://"))
        if not path.is_absolute():
            path = (self.config_dir or Path.cwd()) / path
        if not path.exists():
            raise NotFound(f"workspace {ws.name!r}: repository {path} does not exist; check its repo field")
        return git_dir(path, ws.name)

    def _work_tree(self, ws: Workspace) -> Path | None:
        """The checkout of a working repository; None for a bare one."""
        repo = self._repo(ws)
        return repo.parent if repo.name == ".git" else None

    def _dir(self, ws: Workspace) -> Path:
        key = hashlib.sha256(str(self._repo(ws)).encode()).hexdigest()[:24]
        d = self.forges_dir / key
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return d

    def _records(self, ws: Workspace) -> list[_Record]:
        out: list[_Record] = []
        for p in sorted(self._dir(ws).glob("*.json")):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        return out

    def _save(self, ws: Workspace, rec: _Record) -> None:
        path = self._dir(ws) / f"{rec['number']}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1, sort_keys=True))
        os.replace(tmp, path)

    def _load(self, ws: Workspace, number: str) -> _Record:
        path = self._dir(ws) / f"{number}.json"
        if not path.exists():
            raise NotFound(f"workspace {ws.name!r} has no pull request {number}")
        rec: _Record = json.loads(path.read_text())
        return rec

    async def _sha(self, repo: Path, ref: str) -> str:
        res = await self.git.run(["rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}"],
                                 git_dir=repo, check=False, what="git rev-parse")
        return res.out.strip() if res.returncode == 0 else ""

    async def _contains(self, repo: Path, ref: str, sha: str) -> bool:
        """Whether commit `sha` is on `ref` (it or an ancestor of it)."""
        if not sha:
            return False
        res = await self.git.run(["merge-base", "--is-ancestor", "--end-of-options", sha, ref], git_dir=repo,
                                 check=False, what="git merge-base")
        return res.returncode == 0

    async def _info(self, ws: Workspace, rec: _Record) -> PullRequestInfo:
        head_sha = rec.get("merged_head", "") if rec["state"] == "merged" else \
            await self._sha(self._repo(ws), f"refs/heads/{rec['head']}")
        return PullRequestInfo(number=str(rec["number"]), url=f"local:{ws.name}/pulls/{rec['number']}",
                               head_branch=rec["head"], base_branch=rec["base"], head_sha=head_sha,
                               state=rec["state"], merge_sha=rec.get("merge_sha", ""))

    async def open_pull_request(self, ws: Workspace, head: str, base: str, title: str,
                                body: str) -> PullRequestInfo:
        repo = self._repo(ws)
        async with self._lock:
            for rec in self._records(ws):
                if rec["head"] == head and rec["base"] == base and rec["state"] == "open":
                    return await self._info(ws, rec)
            if not await self._sha(repo, f"refs/heads/{head}"):
                raise FailedPrecondition(f"branch {head} is not in {repo}; push it before opening a pull request")
            if not await self._sha(repo, f"refs/heads/{base}"):
                raise NotFound(f"base branch {base!r} is not in {repo}; check the Workspace's baseBranch")
            number = max([int(r["number"]) for r in self._records(ws)] or [0]) + 1
            rec = {"number": number, "head": head, "base": base, "title": title, "body": body,
                   "state": "open", "created_ms": int(time.time() * 1000), "comments": []}
            self._save(ws, rec)
            return await self._info(ws, rec)

    async def get_pull_request(self, ws: Workspace, number: str) -> PullRequestInfo:
        return await self._info(ws, self._load(ws, number))

    async def merge_pull_request(self, ws: Workspace, number: str, sha: str, method: str,
                                 base_sha: str = "") -> str:
        repo = self._repo(ws)
        async with self._lock:
            rec = self._load(ws, number)
            if rec["state"] == "merged":
                return rec.get("merge_sha", "")
            base_ref = f"refs/heads/{rec['base']}"
            pending = rec.get("merging")
            if pending is not None and pending["sha"] == sha and \
                    await self._contains(repo, base_ref, pending["merge_sha"]):
                # The merge landed but the broker stopped before recording it (R37): record, never merge again.
                rec.pop("merging", None)
                rec.update({"state": "merged", "merge_sha": pending["merge_sha"], "merged_head": sha,
                            "merged_ms": int(time.time() * 1000)})
                self._save(ws, rec)
                return rec["merge_sha"]
            base = await self._sha(repo, base_ref)
            if not base:
                raise NotFound(f"base branch {rec['base']!r} is gone from {repo}")
            if base_sha and base != base_sha:      # under the lock: the tip merged onto is the verified one
                raise Aborted(f"the base branch {rec['base']} moved to {base[:12]} since the head was verified "
                              f"on {base_sha[:12]}; it is verified again")
            if method == "rebase":
                raise InvalidArgument("the local forge merges with 'merge' or 'squash'; set forge.mergeMethod")
            res = await self.git.run(["merge-tree", "--write-tree", "--no-messages", "-z",
                                      "--end-of-options", base, sha], git_dir=repo, check=False,
                                     what="git merge-tree")
            if res.returncode == 1:
                raise FailedPrecondition(f"pull request {number} conflicts with {rec['base']}; "
                                         "update the branch and approve again")
            if res.returncode != 0:
                raise FailedPrecondition(f"pull request {number} cannot be merged: {res.err.strip()[:300]}")
            work_tree = await self._checked_out(ws, repo, base_ref)
            if work_tree is not None:
                await self._require_clean(work_tree, repo, rec["base"])
            tree = res.stdout.split(b"\0")[0].decode().strip()
            parents = ["-p", base] + (["-p", sha] if method == "merge" else [])
            title = rec.get("title") or f"Merge {rec['head']}"
            msg = f"{title} (#{number})\n\nMerge {rec['head']} into {rec['base']}.\n"
            env = {"GIT_AUTHOR_NAME": ws.author.name, "GIT_AUTHOR_EMAIL": ws.author.email,
                   "GIT_COMMITTER_NAME": ws.author.name, "GIT_COMMITTER_EMAIL": ws.author.email}
            out = await self.git.run(["commit-tree", *parents, "-F", "-", tree], git_dir=repo, env=env,
                                     stdin=msg.encode(), what="git commit-tree")
            merge_sha = out.out.strip()
            rec["merging"] = {"sha": sha, "merge_sha": merge_sha}   # written ahead: see the top of this method
            self._save(ws, rec)
            await self._advance(ws, repo, base_ref, base, merge_sha)
            rec.pop("merging", None)
            rec.update({"state": "merged", "merge_sha": merge_sha, "merged_head": sha,
                        "merged_ms": int(time.time() * 1000)})
            self._save(ws, rec)
            return merge_sha

    async def _checked_out(self, ws: Workspace, repo: Path, ref: str) -> Path | None:
        """The checkout of a working repository when `ref` is its current branch."""
        work_tree = self._work_tree(ws)
        if work_tree is None:
            return None
        head = await self.git.run(["symbolic-ref", "--quiet", "HEAD"], git_dir=repo, check=False,
                                  what="git symbolic-ref")
        return work_tree if head.out.strip() == ref else None

    async def _require_clean(self, work_tree: Path, repo: Path, branch: str) -> None:
        st = await self.git.run(["status", "--porcelain", "--untracked-files=no"], git_dir=repo,
                                work_tree=work_tree, cwd=work_tree, what="git status")
        if st.out.strip():
            raise FailedPrecondition(f"{work_tree} has uncommitted changes on {branch}, which the merge would "
                                     "have to overwrite; commit or stash them, then approve again")

    async def _advance(self, ws: Workspace, repo: Path, ref: str, old: str, new: str) -> None:
        """Move `ref` from `old` to `new`; when it is checked out, move its files too."""
        work_tree = await self._checked_out(ws, repo, ref)
        if work_tree is None:
            await self.git.run(["update-ref", "--end-of-options", ref, new, old], git_dir=repo,
                               what="git update-ref")
            return
        # Fast-forward only: refused (nothing changed) if the branch moved since `old`.
        res = await self.git.run(["merge", "--ff-only", "--no-edit", "--quiet", "--end-of-options", new],
                                 git_dir=repo, work_tree=work_tree, cwd=work_tree, check=False,
                                 what="git merge --ff-only")
        if res.returncode != 0:
            raise FailedPrecondition(f"could not update the checkout {work_tree}: {res.err.strip()[:300]}; "
                                     "commit or stash local changes there, then approve again")

    async def comment(self, ws: Workspace, number: str, body: str) -> str:
        async with self._lock:
            rec = self._load(ws, number)
            rec.setdefault("comments", []).append({"body": body, "at_ms": int(time.time() * 1000)})
            self._save(ws, rec)
        return f"local:{ws.name}/pulls/{number}#comment-{len(rec['comments'])}"
