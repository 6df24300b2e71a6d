"""The `github` forge: GitHub REST (or GitHub Enterprise at a configured base
URL). The token travels only in the `Authorization` header (R14).

With `forge.pushRepo` the ticket's branch lives in that fork and the pull
request is opened from it (`head: "<fork owner>:<branch>"`, GitHub's form for
a cross-repository pull request); everything else (the head SHA, merge,
comments, statuses, check runs) goes through the base repository's pull
request as before."""

from __future__ import annotations

import urllib.parse
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from services.common.config.model import Workspace
from services.common.errors import AfeError, FailedPrecondition, InvalidArgument, PermissionDenied
from services.common.secrecy.env_secrets import SecretValue
from services.credentials.forges.base import Forge, PullRequestInfo
from services.credentials.forges.github_events import EventPages, RepoEvents
from services.credentials.forges.reportmarks import carries, marked
from services.credentials.httpclient import HttpClient, Response

# A JSON object of GitHub's REST API (a pull request, a comment), as parsed.
GitHubObject = dict[str, Any]

MAX_COMMENT_PAGES = 30          # 3000 comments: an issue's marked report is looked for no further


class GitHubForge(Forge):
    def __init__(self, http: HttpClient, tokens: dict[str, SecretValue], timeout_s: float = 60.0) -> None:
        self.http = http
        self.tokens = tokens
        self.timeout_s = timeout_s
        # url -> (ETag, answer) of conditional reads (github_checks.py), oldest first
        self.etags: OrderedDict[str, tuple[str, Response]] = OrderedDict()

    def _repo(self, ws: Workspace) -> tuple[str, str]:
        repo = ws.forge.repo.strip()
        owner, _, name = repo.partition("/")
        if not owner or not name or "/" in name:
            raise InvalidArgument(f"workspace {ws.name!r}: forge.repo must be 'owner/name', got {repo!r}")
        return owner, name

    def _headers(self, ws: Workspace) -> dict[str, str]:
        if not ws.token_env:
            raise FailedPrecondition(f"workspace {ws.name!r}: the github forge needs a token; "
                                     "set tokenEnv on the Workspace")
        secret = self.tokens.get(ws.token_env)
        if secret is None:
            raise FailedPrecondition(f"workspace {ws.name!r}: environment variable {ws.token_env} (its tokenEnv) "
                                     "is not set in the credential broker's environment")
        return {
            "Authorization": f"Bearer {secret.reveal()}",
            "Accept": "application/vnd.github+json",
            "X-GitHub-Api-Version": "2022-11-28",
        }

    def _url(self, ws: Workspace, *parts: str, query: dict[str, str] | None = None) -> str:
        owner, name = self._repo(ws)
        base = ws.forge.base_url.rstrip("/")
        path = "/".join(urllib.parse.quote(p, safe="") for p in ("repos", owner, name, *parts))
        url = f"{base}/{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        return url

    async def _call(self, ws: Workspace, method: str, url: str, what: str,
                    body: dict[str, str] | None = None) -> Response:
        resp = await self.http.request(method, url, headers=self._headers(ws), json_body=body,
                                       timeout_s=self.timeout_s, what=f"GitHub {what}")
        return resp

    def _fail(self, ws: Workspace, resp: Response, what: str) -> AfeError:
        return self.http.error(resp, f"GitHub {what} for workspace {ws.name!r}",
                               hint_auth=f"check the token in {ws.token_env} and its permissions "
                                         "(contents and pull requests: read and write"
                                         + (f"; contents: write on the fork {ws.forge.push_repo}"
                                            if ws.forge.push_repo else "") + ")")

    @staticmethod
    def _info(pr: GitHubObject) -> PullRequestInfo:
        state = "merged" if pr.get("merged") or pr.get("merged_at") else str(pr.get("state", "open"))
        return PullRequestInfo(
            number=str(pr.get("number", "")),
            url=str(pr.get("html_url", "")),
            head_branch=str((pr.get("head") or {}).get("ref", "")),
            base_branch=str((pr.get("base") or {}).get("ref", "")),
            head_sha=str((pr.get("head") or {}).get("sha", "")),
            state=state,
            merge_sha=str(pr.get("merge_commit_sha") or "") if state == "merged" else "",
        )

    def _head_owner(self, ws: Workspace) -> str:
        """The owner of the repository the ticket's branch is pushed to: the fork's with pushRepo."""
        if ws.forge.push_repo:
            return ws.forge.push_repo.partition("/")[0]
        return self._repo(ws)[0]

    @staticmethod
    def _from(ws: Workspace, pr: GitHubObject, head: str) -> bool:
        """Whether the pull request `pr` (GitHub's JSON) comes from the branch `head` of the
        repository afe pushes to (the fork with pushRepo; never a same-named branch elsewhere)."""
        h = pr.get("head") or {}
        if h.get("ref") != head:
            return False
        full = str((h.get("repo") or {}).get("full_name") or "")
        return not ws.forge.push_repo or full.lower() == ws.forge.push_repo.lower()

    async def _find_open(self, ws: Workspace, head: str, base: str) -> PullRequestInfo | None:
        owner = self._head_owner(ws)
        url = self._url(ws, "pulls", query={"head": f"{owner}:{head}", "base": base, "state": "open"})
        resp = await self._call(ws, "GET", url, "pull request search")
        if not resp.ok:
            raise self._fail(ws, resp, "pull request search")
        if isinstance(resp.body, list):
            for pr in resp.body:
                if isinstance(pr, dict) and self._from(ws, pr, head):
                    return self._info(pr)
        return None

    async def open_pull_request(self, ws: Workspace, head: str, base: str, title: str,
                                body: str) -> PullRequestInfo:
        found = await self._find_open(ws, head, base)
        if found is not None:
            return found
        # From a fork GitHub names the head "<owner>:<branch>"; the base repository stays the PR's home.
        api_head = f"{self._head_owner(ws)}:{head}" if ws.forge.push_repo else head
        resp = await self._call(ws, "POST", self._url(ws, "pulls"), "pull request creation",
                                {"title": title, "head": api_head, "base": base, "body": body})
        if resp.status == 422:  # e.g. created concurrently: find it again
            found = await self._find_open(ws, head, base)
            if found is not None:
                return found
        if not resp.ok or not isinstance(resp.body, dict):
            raise self._fail(ws, resp, "pull request creation")
        return self._info(resp.body)

    async def get_pull_request(self, ws: Workspace, number: str) -> PullRequestInfo:
        resp = await self._call(ws, "GET", self._url(ws, "pulls", number), "pull request lookup")
        if not resp.ok or not isinstance(resp.body, dict):
            raise self._fail(ws, resp, f"pull request {number} lookup")
        return self._info(resp.body)

    async def merge_pull_request(self, ws: Workspace, number: str, sha: str, method: str,
                                 base_sha: str = "") -> str:
        # `sha` makes GitHub itself refuse if the head moved after approval (R16). GitHub's merge
        # takes no base tip: the broker compared it right before (a base moving in between is
        # the one window left, docs/SECURITY.md R41).
        resp = await self._call(ws, "PUT", self._url(ws, "pulls", number, "merge"), "merge",
                                {"merge_method": method, "sha": sha})
        if resp.status == 409:
            raise PermissionDenied(f"GitHub refused to merge pull request {number}: its head is no longer "
                                   "the approved commit; approve the new head (R16)")
        if not resp.ok or not isinstance(resp.body, dict):
            raise self._fail(ws, resp, f"merge of pull request {number}")
        return str(resp.body.get("sha", ""))

    async def comment(self, ws: Workspace, number: str, body: str) -> str:
        resp = await self._call(ws, "POST", self._url(ws, "issues", number, "comments"), "comment",
                                {"body": body})
        if not resp.ok or not isinstance(resp.body, dict):
            raise self._fail(ws, resp, f"comment on pull request {number}")
        return str(resp.body.get("html_url", ""))

    # -- GitHub intake (docs/GITHUB.md) ------------------------------------------

    async def permission(self, ws: Workspace, username: str) -> str:
        """admin | write | read | none: GitHub's `permission` for `username` on the repository."""
        url = self._url(ws, "collaborators", username, "permission")
        resp = await self._call(ws, "GET", url, "permission lookup")
        if resp.status == 404:
            return "none"      # not a collaborator (or no such user)
        if not resp.ok or not isinstance(resp.body, dict):
            raise self._fail(ws, resp, "permission lookup")
        value = resp.body.get("permission")
        return value if value in ("admin", "maintain", "write", "triage", "read", "none") else "none"

    async def repo_events(self, ws: Workspace, etag: str, after_id: str = "") -> RepoEvents:
        """The repository's events newer than `after_id`, newest first (github_events.py)."""
        once = replace(self.http.retry, retry_limits=False)   # the scheduler keeps the wait, across restarts

        async def get(page: int, if_none_match: str) -> Response:
            headers = self._headers(ws)
            if if_none_match:
                headers["If-None-Match"] = if_none_match
            url = self._url(ws, "events", query={"per_page": "100", **({"page": str(page)} if page > 1 else {})})
            return await self.http.request("GET", url, headers=headers, timeout_s=self.timeout_s,
                                           what="GitHub repository events", retry=once)

        def fail(resp: Response) -> Exception:
            return self.http.error(resp, f"GitHub repository events for workspace {ws.name!r}",
                                   hint_auth=f"check the token in {ws.token_env}: it needs Metadata: read")

        return await EventPages(get, fail).read(etag, after_id)

    # -- reporting back (docs/GITHUB.md, "Reporting back") -------------------------

    async def find_marked_comment(self, ws: Workspace, number: str, the_mark: str) -> GitHubObject | None:
        """The earliest comment of the issue whose body ends with `the_mark` (oldest first, as
        GitHub lists them; at most MAX_COMMENT_PAGES pages of 100)."""
        for page in range(1, MAX_COMMENT_PAGES + 1):
            url = self._url(ws, "issues", number, "comments", query={"per_page": "100", "page": str(page)})
            resp = await self._call(ws, "GET", url, "comment list")
            if not resp.ok or not isinstance(resp.body, list):
                raise self._fail(ws, resp, f"comment list of issue {number}")
            for c in resp.body:
                if isinstance(c, dict) and carries(c.get("body"), the_mark):
                    return c
            if len(resp.body) < 100:
                return None
        return None

    async def upsert_comment(self, ws: Workspace, number: str, body: str, the_mark: str) -> tuple[str, str, bool]:
        """(comment id, url, created): edit the marked comment, or post it when there is none."""
        full = marked(body, the_mark)
        found = await self.find_marked_comment(ws, number, the_mark)
        if found is not None:
            cid = str(found.get("id", ""))
            if found.get("body") == full:
                return cid, str(found.get("html_url", "")), False
            resp = await self._call(ws, "PATCH", self._url(ws, "issues", "comments", cid), "comment edit",
                                    {"body": full})
            if not resp.ok or not isinstance(resp.body, dict):
                raise self._fail(ws, resp, f"edit of comment {cid} on issue {number}")
            return cid, str(resp.body.get("html_url", "")), False
        resp = await self._call(ws, "POST", self._url(ws, "issues", number, "comments"), "comment", {"body": full})
        if not resp.ok or not isinstance(resp.body, dict):
            raise self._fail(ws, resp, f"comment on issue {number}")
        return str(resp.body.get("id", "")), str(resp.body.get("html_url", "")), True

    async def set_status(self, ws: Workspace, sha: str, state: str, context: str, description: str,
                         target_url: str) -> None:
        body = {"state": state, "context": context, "description": description}
        if target_url:
            body["target_url"] = target_url
        resp = await self._call(ws, "POST", self._url(ws, "statuses", sha), "commit status", body)
        if not resp.ok:
            raise self._fail(ws, resp, f"commit status on {sha[:12]}")

    async def close(self) -> None:
        await self.http.close()
