"""A GitHub-REST-compatible fake: pulls (list/create/get/merge) and issue
comments, with the Authorization header checked. `branches` maps a branch
name to its head SHA (tests set it, e.g. after a push); merging records the
merge and refuses a stale `sha` with 409 like GitHub does."""

from __future__ import annotations

import hashlib

from aiohttp import web

from .base import FakeServer


class FakeGitHub(FakeServer):
    def __init__(self, token: str, repo: str = "acme/widgets") -> None:
        super().__init__()
        self.token = token
        self.repo = repo
        self.branches: dict[str, str] = {}
        self.pulls: dict[int, dict] = {}
        self.comments: list[dict] = []
        self.merges: list[dict] = []

    def routes(self, app: web.Application) -> None:
        base = "/repos/{owner}/{name}"
        app.router.add_get(base + "/pulls", self.list_pulls)
        app.router.add_post(base + "/pulls", self.create_pull)
        app.router.add_get(base + "/pulls/{n}", self.get_pull)
        app.router.add_put(base + "/pulls/{n}/merge", self.merge_pull)
        app.router.add_post(base + "/issues/{n}/comments", self.comment)

    def _check(self, request: web.Request) -> web.Response | None:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"message": "Bad credentials"}, status=401)
        if f"{request.match_info['owner']}/{request.match_info['name']}" != self.repo:
            return web.json_response({"message": "Not Found"}, status=404)
        return None

    def _view(self, pr: dict) -> dict:
        head_sha = pr["merged_head"] if pr["merged"] else self.branches.get(pr["head"], "")
        return {
            "number": pr["number"], "html_url": f"{self.url}/{self.repo}/pull/{pr['number']}",
            "state": "closed" if pr["merged"] else pr["state"], "merged": pr["merged"],
            "merged_at": "2026-01-01T00:00:00Z" if pr["merged"] else None,
            "merge_commit_sha": pr.get("merge_sha"),
            "head": {"ref": pr["head"], "sha": head_sha}, "base": {"ref": pr["base"]},
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
            if head and head != f"{self.repo.split('/')[0]}:{pr['head']}":
                continue
            if state != "all" and view["state"] != state:
                continue
            out.append(view)
        return web.json_response(out)

    async def create_pull(self, request):
        if (r := self._check(request)) is not None:
            return r
        body = await request.json()
        if body.get("head") not in self.branches:
            return web.json_response({"message": "Validation Failed",
                                      "errors": [{"message": f"head {body.get('head')} does not exist"}]},
                                     status=422)
        for pr in self.pulls.values():
            if pr["head"] == body["head"] and pr["state"] == "open" and not pr["merged"]:
                return web.json_response({"message": "Validation Failed",
                                          "errors": [{"message": "A pull request already exists"}]}, status=422)
        n = len(self.pulls) + 1
        self.pulls[n] = {"number": n, "head": body["head"], "base": body["base"], "title": body.get("title", ""),
                         "body": body.get("body", ""), "state": "open", "merged": False}
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
        head = self.branches.get(pr["head"], "")
        if body.get("sha") and body["sha"] != head:
            return web.json_response({"message": "Head branch was modified. Review and try the merge again."},
                                     status=409)
        merge_sha = hashlib.sha1(f"{head}:{len(self.merges)}".encode()).hexdigest()
        pr.update(merged=True, merged_head=head, merge_sha=merge_sha)
        self.merges.append({"number": pr["number"], "method": body.get("merge_method"), "sha": body.get("sha")})
        return web.json_response({"sha": merge_sha, "merged": True, "message": "Pull Request successfully merged"})

    async def comment(self, request):
        if (r := self._check(request)) is not None:
            return r
        body = await request.json()
        self.comments.append({"number": int(request.match_info["n"]), "body": body.get("body", "")})
        return web.json_response({"html_url": f"{self.url}/{self.repo}/pull/{request.match_info['n']}"
                                              f"#issuecomment-{len(self.comments)}"}, status=201)


__all__ = ["FakeGitHub"]
