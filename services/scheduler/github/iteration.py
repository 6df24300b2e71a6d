"""Review iteration on a pull request afe opened (docs/GITHUB.md): a review
asking for changes, a review comment or a `/afe ...` comment becomes a
follow-up of its ticket, from a person with write access only (R36). Mixed
into `GitHubIntake` (github_intake.py)."""

from __future__ import annotations

from typing import Any

from services.common.config.model import Config

from ..store.store import Store
from .outcome import Outcome, _text


class ReviewIteration:
    config: Config
    store: Store

    async def _unless_writer(self, ws: Any, login: str, where: str, who: str,
                             consequence: str) -> Outcome | None:
        raise NotImplementedError

    async def _follow_up(self, tid: str, text: str, *, login: str, source: str, path: str, line: int, url: str,
                         delivery: str, review_id: int, what: str) -> Outcome:
        raise NotImplementedError

    def _iteration_request(self, event: str, action: str,
                           data: dict[str, Any]) -> tuple[dict[str, Any], str, str, str, int] | None:
        """(the acting user, text, source, path, line) when the event asks afe's PR for changes."""
        if event == "pull_request_review":
            review = data.get("review") or {}
            if action != "submitted" or _text(review.get("state")).lower() != "changes_requested":
                return None
            text = _text(review.get("body")).strip() or "The reviewer requested changes; see the review comments."
            return review.get("user") or {}, text, "github:review", "", 0
        comment = data.get("comment") or {}
        if action != "created" or not isinstance(comment, dict):
            return None
        body = _text(comment.get("body"))
        if event == "pull_request_review_comment":
            line = comment.get("line") or comment.get("original_line") or 0
            return (comment.get("user") or {}, body, "github:review_comment", _text(comment.get("path")),
                    line if isinstance(line, int) else 0)
        words = body.lstrip().split(maxsplit=1)
        commands = {t.command for t in self.config.triggers.values() if t.command} or {"/afe"}
        if not words or words[0] not in commands:
            return None
        return comment.get("user") or {}, words[1] if len(words) > 1 else "", "github:comment", "", 0

    async def _iterate(self, event: str, action: str, data: dict[str, Any], delivery: str) -> Outcome:
        """A review asking for changes, a review comment or a `/afe ...` comment on a
        pull request afe opened: a follow-up of its ticket (followups.py), from a
        person with write access only (R36); its text reaches the model quoted."""
        repo = _text((data.get("repository") or {}).get("full_name")).lower()
        pr = data.get("pull_request") or data.get("issue") or {}
        number = pr.get("number") if isinstance(pr, dict) else None
        spaces = {t.workspace for t in self.config.triggers.values()}
        workspaces = [ws for ws in self.config.workspaces.values() if ws.name in spaces
                      and ws.forge.type == "github" and repo and ws.forge.repo.lower() == repo]
        if not workspaces:
            return Outcome("ignored", "no_trigger")
        if not isinstance(number, int):
            return Outcome("refused", "bad_payload")
        request = self._iteration_request(event, action, data)
        found = [(ws, tid) for ws in workspaces if (tid := self.store.prs.ticket_for_pr(ws.name, str(number)))]
        if request is None or not found:
            return Outcome("ignored", "not_afe_pull_request")
        user, text, source, path, line = request
        login = _text(user.get("login"))
        if not login or user.get("type") == "Bot" or login.endswith("[bot]"):
            return Outcome("ignored", "bot")
        ws, tid = found[0]
        refused = await self._unless_writer(ws, login, f"github {event}.{action} (delivery {delivery})",
                                            "the reviewer", "no follow-up")
        if refused is not None:
            return refused
        url = _text((data.get("comment") or data.get("review") or {}).get("html_url"))
        if event == "pull_request_review":
            review_id = (data.get("review") or {}).get("id")
        else:
            review_id = (data.get("comment") or {}).get("pull_request_review_id")
        return await self._follow_up(tid, text, login=login, source=source, path=path, line=line, url=url,
                                     delivery=delivery, review_id=review_id if isinstance(review_id, int) else 0,
                                     what=f"github {event}.{action} (delivery {delivery})")
