"""A GitHub-REST-compatible fake: pulls (list/create/get/merge), issue
comments (create, list, edit), commit statuses, check runs and the combined status of a ref, an Actions job's log
(a 302 to a download URL on `/_download/`, served without the token as GitHub's log storage does),
collaborator permissions and repository events (ETag, X-Poll-Interval,
pages with a Link header), with the Authorization header checked. Rate limits as GitHub documents them
("Rate limits for the REST API"): every answer carries X-RateLimit-*; with `rate_remaining` at 0 a call gets
403 "API rate limit exceeded" with X-RateLimit-Remaining: 0 and the reset time; `secondary_limit(...)` answers
403 (or 429) "You have exceeded a secondary rate limit", with Retry-After when given. Given an `OpenApi`
(tests/support/fakes/openapi.py), every request is checked against GitHub's
REST description and the undocumented ones are listed in `undocumented`. `branches` maps a branch
name to its head SHA (tests set it, e.g. after a push); merging records the
merge and refuses a stale `sha` with 409 like GitHub does. `forks` maps a fork's full name to its
branches in the same way: a pull request created with `head: "<fork owner>:<branch>"` comes from that
fork (GitHub's cross-repository pull request; `head.repo` is the fork, `base.repo` this repository),
and `head=<owner>:<branch>` in the list filters by the head's owner as GitHub does."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from .base import FakeServer
from .openapi import OpenApi


class FakeGitHub(FakeServer):
    def __init__(self, token: str, repo: str = "acme/widgets", openapi: OpenApi | None = None) -> None:
        super().__init__()
        self.openapi = openapi
        self.undocumented: list[str] = []
        self.permissions: dict[str, str] = {}     # login -> admin | write | read (absent: 404)
        self.events: list[dict] = []              # repository events, newest first (GitHub's order)
        self.poll_interval = 60
        self.rate_remaining = 4999
        self.rate_reset = int(time.time()) + 3600          # X-RateLimit-Reset, UTC epoch seconds
        self.secondary: tuple[int, dict[str, str]] | None = None   # a secondary limit in force: status, headers
        self.token = token
        self.repo = repo
        self.branches: dict[str, str] = {}
        self.forks: dict[str, dict[str, str]] = {}   # fork full name -> its branches (name -> head SHA)
        self.pulls: dict[int, dict] = {}
        self.comments: list[dict] = []            # {"number", "body"}; a comment's id is its index + 1
        self.edits: list[int] = []                # ids of edited comments, in order
        self.statuses: list[dict] = []            # {"sha", "state", "context", "description", "target_url"}
        self.merges: list[dict] = []
        self.check_runs: list[dict] = []          # GitHub's check run objects (id, name, head_sha, status, ...)
        self.not_modified = 0                     # conditional requests answered 304 (check runs, combined status)
        self.job_logs: dict[int, str] = {}        # Actions job id -> its log
        self.downloads: list[dict] = []           # {"path", "authorization"} of each log download
        # Tests' hooks: `after_comment(id)` is awaited once a comment is stored, before the answer
        # (e.g. to kill the caller); `strip_marks` stores bodies without their HTML comments
        # (a broker that does not mark its comments: the R37 positive control).
        self.after_comment: Callable[[int], Awaitable[None]] | None = None
        self.strip_marks = False

    def routes(self, app: web.Application) -> None:
        base = "/repos/{owner}/{name}"
        app.router.add_get(base + "/pulls", self.list_pulls)
        app.router.add_post(base + "/pulls", self.create_pull)
        app.router.add_get(base + "/pulls/{n}", self.get_pull)
        app.router.add_put(base + "/pulls/{n}/merge", self.merge_pull)
        app.router.add_post(base + "/issues/{n}/comments", self.comment)
        app.router.add_get(base + "/issues/{n}/comments", self.list_comments)
        app.router.add_patch(base + "/issues/comments/{id}", self.edit_comment)
        app.router.add_post(base + "/statuses/{sha}", self.status)
        app.router.add_get(base + "/collaborators/{user}/permission", self.permission)
        app.router.add_get(base + "/events", self.list_events)
        app.router.add_get(base + "/commits/{ref}/check-runs", self.list_check_runs)
        app.router.add_get(base + "/commits/{ref}/status", self.combined_status)
        app.router.add_get(base + "/actions/jobs/{job}/logs", self.job_log)
        app.router.add_get("/_download/jobs/{job}", self.download_log)
        if self.openapi is not None:
            app.middlewares.append(self._documented)

    @web.middleware
    async def _documented(self, request: web.Request, handler):
        assert self.openapi is not None
        if request.path.startswith("/_download/"):      # the log storage host, not the REST API
            return await handler(request)
        problem = self.openapi.problem(request.method, request.path, request.query_string, await request.read())
        if problem is not None:
            self.undocumented.append(problem)
            return web.json_response({"message": "Not Found (undocumented call)"}, status=404)
        return await handler(request)

    def _rate_headers(self) -> dict[str, str]:
        return {"X-RateLimit-Limit": "5000", "X-RateLimit-Remaining": str(max(0, self.rate_remaining)),
                "X-RateLimit-Reset": str(self.rate_reset), "X-RateLimit-Resource": "core"}

    def secondary_limit(self, retry_after: int | None, status: int = 403) -> None:
        """Refuse every call as a secondary rate limit until `secondary = None`."""
        self.secondary = (status, {"Retry-After": str(retry_after)} if retry_after is not None else {})

    def _limited(self) -> web.Response | None:
        if self.secondary is not None:
            status, headers = self.secondary
            return web.json_response(
                {"message": "You have exceeded a secondary rate limit. Please wait a few minutes before you try "
                            "again.", "documentation_url": "https://docs.github.com/rest/using-the-rest-api/"
                            "rate-limits-for-the-rest-api#about-secondary-rate-limits"},
                status=status, headers={**self._rate_headers(), **headers})
        if self.rate_remaining <= 0:
            return web.json_response(
                {"message": "API rate limit exceeded for user ID 1.", "documentation_url": "https://docs.github.com/"
                            "rest/overview/rate-limits-for-the-rest-api#about-primary-rate-limits"},
                status=403, headers=self._rate_headers())
        return None

    def events_etag(self) -> str:
        return 'W/"' + hashlib.sha1(json.dumps(self.events, sort_keys=True).encode()).hexdigest() + '"'

    async def permission(self, request):
        if (r := self._check(request)) is not None:
            return r
        user = request.match_info["user"]
        perm = self.permissions.get(user)
        if perm is None:
            return web.json_response({"message": f"{user} is not a user"}, status=404)
        return web.json_response({"permission": perm, "role_name": perm,
                                  "user": {"login": user, "type": "User"}}, headers=self._rate_headers())

    async def list_events(self, request):
        if (r := self._check(request)) is not None:
            return r
        etag = self.events_etag()
        headers = {"ETag": etag, "X-Poll-Interval": str(self.poll_interval), **self._rate_headers()}
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers=headers)
        self.rate_remaining -= 1
        headers["X-RateLimit-Remaining"] = str(max(0, self.rate_remaining))
        per_page = min(100, int(request.query.get("per_page", "30")))
        page = max(1, int(request.query.get("page", "1")))
        if page * per_page < len(self.events):
            headers["Link"] = f'<{self.url}/repos/{self.repo}/events?per_page={per_page}&page={page + 1}>; rel="next"'
        return web.json_response(self.events[(page - 1) * per_page:page * per_page], headers=headers)

    def _check(self, request: web.Request) -> web.Response | None:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"message": "Bad credentials"}, status=401)
        if f"{request.match_info['owner']}/{request.match_info['name']}" != self.repo:
            return web.json_response({"message": "Not Found"}, status=404)
        return self._limited()

    def _branches_of(self, repo: str) -> dict[str, str]:
        return self.branches if repo == self.repo else self.forks[repo]

    def _head_repo(self, head: str) -> tuple[str, str] | None:
        """(repository, branch) of a pull request's `head` ("branch" or "owner:branch"); None: no such owner."""
        owner, sep, branch = head.rpartition(":")
        if not sep or owner == self.repo.split("/")[0]:
            return self.repo, branch
        return next(((f, branch) for f in self.forks if f.split("/")[0] == owner), None)

    def _view(self, pr: dict) -> dict:
        repo = pr.get("head_repo", self.repo)
        head_sha = pr["merged_head"] if pr["merged"] else self._branches_of(repo).get(pr["head"], "")
        return {
            "number": pr["number"], "html_url": f"{self.url}/{self.repo}/pull/{pr['number']}",
            "state": "closed" if pr["merged"] else pr["state"], "merged": pr["merged"],
            "merged_at": "2026-01-01T00:00:00Z" if pr["merged"] else None,
            "merge_commit_sha": pr.get("merge_sha"),
            "head": {"ref": pr["head"], "sha": head_sha, "label": f"{repo.split('/')[0]}:{pr['head']}",
                     "repo": {"full_name": repo, "fork": repo != self.repo}},
            "base": {"ref": pr["base"], "label": f"{self.repo.split('/')[0]}:{pr['base']}",
                     "repo": {"full_name": self.repo, "fork": False}},
            "title": pr["title"], "body": pr["body"],
        }

    async def list_pulls(self, request):
        if (r := self._check(request)) is not None:
            return r
        head = request.query.get("head", "")
        state = request.query.get("state", "open")
        out = []
        for pr in self.pulls.values():
            view = self._view(pr)
            if head and head != view["head"]["label"]:
                continue
            if state != "all" and view["state"] != state:
                continue
            out.append(view)
        return web.json_response(out)

    async def create_pull(self, request):
        if (r := self._check(request)) is not None:
            return r
        body = await request.json()
        found = self._head_repo(str(body.get("head", "")))
        if found is None or found[1] not in self._branches_of(found[0]):
            return web.json_response({"message": "Validation Failed",
                                      "errors": [{"message": f"head {body.get('head')} does not exist"}]},
                                     status=422)
        repo, branch = found
        for pr in self.pulls.values():
            if (pr["head"], pr.get("head_repo", self.repo)) == (branch, repo) and pr["state"] == "open" \
                    and not pr["merged"]:
                return web.json_response({"message": "Validation Failed",
                                          "errors": [{"message": "A pull request already exists"}]}, status=422)
        n = len(self.pulls) + 1
        self.pulls[n] = {"number": n, "head": branch, "head_repo": repo, "base": body["base"],
                         "title": body.get("title", ""), "body": body.get("body", ""), "state": "open",
                         "merged": False}
        return web.json_response(self._view(self.pulls[n]), status=201)

    async def get_pull(self, request):
        if (r := self._check(request)) is not None:
            return r
        pr = self.pulls.get(int(request.match_info["n"]))
        if pr is None:
            return web.json_response({"message": "Not Found"}, status=404)
        return web.json_response(self._view(pr))

    async def merge_pull(self, request):
        if (r := self._check(request)) is not None:
            return r
        pr = self.pulls.get(int(request.match_info["n"]))
        if pr is None:
            return web.json_response({"message": "Not Found"}, status=404)
        body = await request.json()
        if pr["merged"]:
            return web.json_response({"message": "Pull Request is not mergeable"}, status=405)
        head = self._branches_of(pr.get("head_repo", self.repo)).get(pr["head"], "")
        if body.get("sha") and body["sha"] != head:
            return web.json_response({"message": "Head branch was modified. Review and try the merge again."},
                                     status=409)
        merge_sha = hashlib.sha1(f"{head}:{len(self.merges)}".encode()).hexdigest()
        pr.update(merged=True, merged_head=head, merge_sha=merge_sha)
        self.merges.append({"number": pr["number"], "method": body.get("merge_method"), "sha": body.get("sha")})
        return web.json_response({"sha": merge_sha, "merged": True, "message": "Pull Request successfully merged"})

    def _comment_view(self, cid: int) -> dict:
        c = self.comments[cid - 1]
        return {"id": cid, "node_id": f"IC_{cid}", "body": c["body"],
                "url": f"{self.url}/repos/{self.repo}/issues/comments/{cid}",
                "html_url": f"{self.url}/{self.repo}/issues/{c['number']}#issuecomment-{cid}",
                "issue_url": f"{self.url}/repos/{self.repo}/issues/{c['number']}",
                "user": {"login": "afe-bot", "id": 1, "type": "User"}, "author_association": "MEMBER",
                "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z"}

    async def comment(self, request):
        if (r := self._check(request)) is not None:
            return r
        body = await request.json()
        text = body.get("body", "")
        if self.strip_marks:
            text = re.sub(r"\s*<!--.*?-->", "", text, flags=re.DOTALL)
        self.comments.append({"number": int(request.match_info["n"]), "body": text})
        cid = len(self.comments)
        if self.after_comment is not None:
            await self.after_comment(cid)
        return web.json_response(self._comment_view(cid), status=201)

    async def list_comments(self, request):
        if (r := self._check(request)) is not None:
            return r
        n = int(request.match_info["n"])
        per_page = min(100, int(request.query.get("per_page", "30")))
        page = max(1, int(request.query.get("page", "1")))
        ids = [i + 1 for i, c in enumerate(self.comments) if c["number"] == n]
        shown = ids[(page - 1) * per_page:page * per_page]
        return web.json_response([self._comment_view(i) for i in shown], headers=self._rate_headers())

    async def edit_comment(self, request):
        if (r := self._check(request)) is not None:
            return r
        cid = int(request.match_info["id"])
        if not 1 <= cid <= len(self.comments):
            return web.json_response({"message": "Not Found"}, status=404)
        body = await request.json()
        self.comments[cid - 1]["body"] = body.get("body", "")
        self.edits.append(cid)
        return web.json_response(self._comment_view(cid))

    async def status(self, request):
        if (r := self._check(request)) is not None:
            return r
        body = await request.json()
        if body.get("state") not in ("pending", "success", "failure", "error"):
            return web.json_response({"message": "Validation Failed"}, status=422)
        sha = request.match_info["sha"]
        self.statuses.append({"sha": sha, "state": body["state"], "context": body.get("context", "default"),
                              "description": body.get("description"), "target_url": body.get("target_url")})
        return web.json_response({"id": len(self.statuses), "state": body["state"],
                                  "context": body.get("context", "default"),
                                  "url": f"{self.url}/repos/{self.repo}/statuses/{sha}"}, status=201)

    async def list_check_runs(self, request):
        if (r := self._check(request)) is not None:
            return r
        ref = request.match_info["ref"]
        runs = [{"status": "completed", "details_url": None, "html_url": f"{self.url}/{self.repo}/runs/{c['id']}",
                 "output": {"title": None, "summary": None, "text": None, "annotations_count": 0},
                 "app": {"slug": "github-actions", "name": "GitHub Actions"}, **c}
                for c in self.check_runs if c["head_sha"] == ref]
        return self._conditional(request, {"total_count": len(runs), "check_runs": runs})

    async def combined_status(self, request):
        if (r := self._check(request)) is not None:
            return r
        ref = request.match_info["ref"]
        latest: dict[str, dict] = {}
        for i, s in enumerate(self.statuses):       # GitHub: the latest status per context
            if s["sha"] == ref:
                latest[s["context"]] = {"id": i + 1, "state": s["state"], "context": s["context"],
                                        "description": s.get("description"), "target_url": s.get("target_url"),
                                        "url": f"{self.url}/repos/{self.repo}/statuses/{ref}"}
        states = {s["state"] for s in latest.values()}
        state = ("failure" if states & {"failure", "error"} else "pending" if "pending" in states or not states
                 else "success")
        return self._conditional(request, {"state": state, "sha": ref, "total_count": len(latest),
                                           "statuses": list(latest.values()), "repository": {"full_name": self.repo},
                                           "commit_url": f"{self.url}/repos/{self.repo}/commits/{ref}",
                                           "url": f"{self.url}/repos/{self.repo}/commits/{ref}/status"})

    def _conditional(self, request, body: dict):
        """GitHub's conditional requests: an ETag on the answer; the same If-None-Match gets
        304 Not Modified, which does not count against the rate limit."""
        etag = '"' + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32] + '"'
        if request.headers.get("If-None-Match") == etag:
            self.not_modified += 1
            return web.Response(status=304, headers={"ETag": etag, **self._rate_headers()})
        self.rate_remaining -= 1
        return web.json_response(body, headers={"ETag": etag, **self._rate_headers()})

    async def job_log(self, request):
        if (r := self._check(request)) is not None:
            return r
        job = int(request.match_info["job"])
        if job not in self.job_logs:
            return web.json_response({"message": "Not Found"}, status=404)
        return web.Response(status=302, headers={"Location": f"{self.url}/_download/jobs/{job}?sig=signed",
                                                 **self._rate_headers()})

    async def download_log(self, request):
        self.downloads.append({"path": request.path, "authorization": request.headers.get("Authorization", "")})
        job = int(request.match_info["job"])
        if request.query.get("sig") != "signed" or job not in self.job_logs:
            return web.Response(status=403, text="AuthenticationFailed")
        return web.Response(text=self.job_logs[job], content_type="text/plain")


__all__ = ["FakeGitHub"]
