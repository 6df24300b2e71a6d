"""GitHub events -> tickets, through the Trigger manifests (docs/GITHUB.md).

Two ways in, one path: a webhook delivery the gateway has authenticated
(R35: signature, size, event type) arrives as `deliver()`; the polling mode
(`Poller`) reads the repository's events through the credential broker and
hands each new one to the same `_handle()`.

What holds here:
- Once per delivery (R35): the delivery id (or `poll:<event id>`) is
  claimed in the store before anything else happens; a replay is a
  `duplicate` and changes nothing, across restarts.
- Only people with write access start work (R36): the GitHub login whose
  action it was (the labeller, the assigner, the commenter) is looked up
  through the credential broker (`GET .../collaborators/{u}/permission`,
  cached there briefly); anyone else gets no ticket, at most one polite
  comment per issue and person, and a counted refusal. Bots are ignored.
- One ticket per piece of work: while the ticket a Trigger started for an
  issue is live, a further event of that Trigger for that issue (another
  delivery of the same label, `labeled` again, the assignment that came with
  the label) joins it: an event on the ticket names the delivery, the
  outcome is `duplicate`/`joined`. The claim of (repository, issue, Trigger)
  is one row in the store, taken atomically (`Store.claim_work`), so this
  holds for webhooks and polling and across schedulers on one PostgreSQL; it
  is taken over once its ticket has ended, or never got one (a crash).
- Follow-ups on afe's pull requests are stored first and re-open the ticket
  together (followups.FollowUpQueue): a review and its inline comments are
  one re-run; what comes while the ticket runs is queued for the next one.
- Untrusted text stays data (R36): the Trigger fixes the workspace and the
  workflow; issue and comment text only ever become the ticket's title,
  body and the inputs the Trigger maps, each marked untrusted in the
  ticket's `origin`. Nothing here parses that text beyond the command word.
- Nothing is logged of a payload but its event, action and delivery id.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from typing import Any

from prometheus_client import CollectorRegistry

from services.common.config.model import Config, Trigger, Workspace
from services.common.errors import AfeError, DeadlineExceeded, ResourceExhausted, Unavailable
from services.common.observability.metrics import github_deliveries

from ..engine.followups import SETTLE_S, FollowUpQueue
from ..engine.tickets import MAX_BODY_BYTES, MAX_INPUT_BYTES, MAX_TITLE_CHARS
from ..engine.view import TicketView
from ..sandboxes.brokers import CredentialsClient
from ..store.base import TERMINAL
from ..store.github_records import WorkClaim
from ..store.store import Store
from .ci import CI_EVENTS, CI_SETTLE_S, CiIteration
from .delivery import decode_payload, unclaimed_on_failure
from .iteration import ReviewIteration
from .outcome import Outcome, _text

log = logging.getLogger(__name__)

SUBSCRIBED = ("issues", "issue_comment", "pull_request_review", "pull_request_review_comment", *CI_EVENTS)
DELIVERY_ID = re.compile(r"^[A-Za-z0-9-]{1,100}$")
MAX_PAYLOAD = 1024 * 1024
REFUSAL_COMMENT = ("Thanks for the request. Only people with write access to this repository can start work "
                   "with afe, so nothing was started. A maintainer can start it for you.")
POLL_INTERVAL_S = 60.0          # at least this, and at least GitHub's X-Poll-Interval
POLL_ERROR_BACKOFF_S = 300.0
# A write-access check failing with these (GitHub's rate limit, the broker or GitHub away) fails the
# delivery instead of refusing it: its claim is released, so the next poll or a redelivery handles it.
TRY_AGAIN: tuple[type[AfeError], ...] = (ResourceExhausted, Unavailable, DeadlineExceeded)
EVENT_TYPES = {"IssuesEvent": "issues", "IssueCommentEvent": "issue_comment"}
# A work claim without a ticket this long was left by a creator that crashed: the next event takes it over.
# Creating a ticket takes milliseconds; this leaves room for the store's own retries.
CLAIM_GRACE_MS = 120_000
# How long an event waits for the ticket another scheduler is creating for the same work before it
# fails (the delivery is answered "redeliver later", a polled event is tried again by the next poll).
JOIN_WAIT_S = 5.0
JOINED_EVENT = "github.joined"


def _clip_utf8(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", errors="ignore")


def _label_matches(label: str, labels: tuple[str, ...]) -> bool:
    """GitHub treats label names case-insensitively (`AFE` is the label `afe`), as it does logins."""
    return label.lower() in {n.lower() for n in labels}


class GitHubIntake(ReviewIteration, CiIteration):
    def __init__(self, config: Config, store: Store, engine: Any, credentials: CredentialsClient,
                 registry: CollectorRegistry | None = None, *, settle_s: float = SETTLE_S) -> None:
        self.config = config
        self.store = store
        self.engine = engine            # Engine.create_ticket (kept loose: the engine imports nothing of us)
        self.credentials = credentials
        self.metrics = github_deliveries(registry, "scheduler") if registry is not None else None
        # Review iteration: follow-ups gathered for `settle_s`, queued while their ticket runs.
        self.followups = (FollowUpQueue(engine, settle_s=settle_s, reply=self._reply_on_pr,
                                        stale_ci=self.ci_dropped) if engine is not None else None)
        self.ci_settle_s = max(settle_s, CI_SETTLE_S)   # failing CI: ci.py

    def start(self) -> None:
        """Owed re-opens of a scheduler that stopped with follow-ups pending."""
        if self.followups is not None:
            self.followups.start()
            self.ci_resume()

    async def stop(self) -> None:
        await self.ci_stop()
        if self.followups is not None:
            await self.followups.close()

    def _count(self, o: Outcome) -> Outcome:
        if self.metrics is not None:
            self.metrics.labels(outcome=o.outcome, reason=o.reason).inc()
        return o

    # -- the two ways in ------------------------------------------------------

    async def deliver(self, delivery_id: str, event: str, payload: bytes) -> Outcome:
        """A webhook delivery the gateway authenticated (R35)."""
        if not DELIVERY_ID.match(delivery_id or ""):
            return self._count(Outcome("refused", "bad_delivery_id"))
        if event not in SUBSCRIBED:
            return self._count(Outcome("ignored", "unsubscribed_event"))
        if len(payload) > MAX_PAYLOAD:
            return self._count(Outcome("refused", "too_large"))
        data = decode_payload(payload)
        if data is None:
            return self._count(Outcome("refused", "bad_payload"))
        key = f"delivery:{delivery_id}"
        if not self.store.intake.claim_once(key, int(time.time() * 1000)):
            log.info("github delivery %s (%s) seen before: ignored", delivery_id, event)
            return self._count(Outcome("duplicate", "duplicate"))
        with unclaimed_on_failure(self.store, key, delivery_id, event):
            return self._count(await self._handle(event, data, delivery_id))

    async def poll_event(self, ws: Workspace, e: Any) -> Outcome:
        """One event of ListRepoEvents, shaped like the webhook it stands for."""
        event = EVENT_TYPES.get(e.type)
        if event is None:
            return Outcome("ignored", "unsubscribed_event")      # not counted: most repository events
        data = decode_payload(e.payload_json.encode())     # lone surrogate escapes become U+FFFD here too
        if data is None:
            return self._count(Outcome("refused", "bad_payload"))
        data["repository"] = {"full_name": e.repo or ws.forge.repo}
        data["sender"] = {"login": e.actor_login, "type": "Bot" if e.actor_login.endswith("[bot]") else "User"}
        key = f"poll:{ws.forge.repo.lower()}:{e.id}"
        if not self.store.intake.claim_once(key, int(time.time() * 1000)):
            return self._count(Outcome("duplicate", "duplicate"))
        with unclaimed_on_failure(self.store, key, f"poll:{e.id}", event):   # the next poll tries it again
            return self._count(await self._handle(event, data, f"poll:{e.id}"))

    # -- matching ---------------------------------------------------------------

    def _matches(self, event: str, data: dict[str, Any]) -> list[tuple[Trigger, Workspace]]:
        repo = _text((data.get("repository") or {}).get("full_name")).lower()
        action = data.get("action")
        out: list[tuple[Trigger, Workspace]] = []
        for tr in self.config.triggers.values():
            ws = self.config.workspaces.get(tr.workspace)
            if ws is None or ws.forge.type != "github" or ws.forge.repo.lower() != repo or not repo:
                continue
            if event == "issues" and action == "labeled":
                label = _text((data.get("label") or {}).get("name"))
                hit = bool(label) and _label_matches(label, tr.labels)
            elif event == "issues" and action == "assigned":
                login = _text((data.get("assignee") or {}).get("login")).lower()
                hit = bool(login) and login in {a.lower() for a in tr.assignees}
            elif event == "issue_comment" and action == "created":
                body = _text((data.get("comment") or {}).get("body")).lstrip()
                word = body.split(maxsplit=1)[0] if body else ""
                hit = bool(tr.command) and word == tr.command
            else:
                hit = False
            if hit:
                out.append((tr, ws))
        return out

    @staticmethod
    def _actor(event: str, data: dict[str, Any]) -> tuple[str, bool]:
        """(the login whose action this was, is it a bot)."""
        sender = data.get("sender") or {}
        user = ((data.get("comment") or {}).get("user") or sender) if event == "issue_comment" else sender
        login = _text(user.get("login"))
        return login, user.get("type") == "Bot" or login.endswith("[bot]")

    async def _handle(self, event: str, data: dict[str, Any], delivery: str) -> Outcome:
        action = _text(data.get("action"))
        if event in CI_EVENTS:
            return await self._ci(event, data, delivery)
        if event.startswith("pull_request_review") or (
                event == "issue_comment" and isinstance(data.get("issue"), dict) and data["issue"].get("pull_request")):
            return await self._iterate(event, action, data, delivery)
        matches = self._matches(event, data)
        if not matches:
            return Outcome("ignored", "no_trigger")
        issue = data.get("issue") or {}
        if not isinstance(issue, dict) or not isinstance(issue.get("number"), int):
            return Outcome("refused", "bad_payload")
        if event == "issue_comment" and issue.get("pull_request"):
            return Outcome("ignored", "pull_request")     # review iteration is its own feature
        login, bot = self._actor(event, data)
        if bot or not login:
            return Outcome("ignored", "bot")
        ws = matches[0][1]
        refused = await self._unless_writer(ws, login, f"github {event}.{action} (delivery {delivery})",
                                            "the sender", "no ticket")
        if refused is not None:
            if refused.reason == "no_write_access":
                await self._refusal_comment(ws, issue["number"], login)
            return refused
        created: list[str] = []
        joined: list[str] = []
        for tr, tws in matches:
            started, tid = await self._start_or_join(tr, tws, event, action, data, issue, login, delivery)
            if tid:
                (created if started else joined).append(tid)
        if created:
            return Outcome("accepted", "ok", created + joined)
        if joined:
            return Outcome("duplicate", "joined", joined)
        return Outcome("refused", "invalid_ticket")

    # -- one ticket per piece of work --------------------------------------------

    async def _start_or_join(self, tr: Trigger, ws: Workspace, event: str, action: str, data: dict[str, Any],
                             issue: dict[str, Any], login: str, delivery: str) -> tuple[bool, str | None]:
        """(True, the new ticket) when this event starts the Trigger's work on the
        issue, (False, its live ticket) when it joins it, (True, None) when the
        ticket could not be created. The claim is taken before the ticket is
        created and given up if that fails, so nothing but a crash leaves a
        claim without a ticket, and such a claim is taken over after
        CLAIM_GRACE_MS."""
        key = (ws.forge.repo.lower(), int(issue["number"]), tr.name)
        token = uuid.uuid4().hex
        deadline = time.monotonic() + JOIN_WAIT_S
        while True:
            held: WorkClaim | None = self.store.intake.claim_work(*key, token, int(time.time() * 1000), CLAIM_GRACE_MS)
            if held is not None and held.claim == token:
                try:
                    tid = self._create(tr, ws, event, action, data, issue, login, delivery)
                except BaseException:
                    self.store.intake.release_work(*key, token)
                    raise
                if tid is None:
                    self.store.intake.release_work(*key, token)
                elif not self.store.intake.set_work_ticket(*key, token, tid):
                    log.warning("github %s.%s (delivery %s): the claim of issue #%s for Trigger %s was taken over "
                                "while ticket %s was created (over %s s)", event, action, delivery, key[1], tr.name,
                                tid, CLAIM_GRACE_MS // 1000)
                return True, tid
            live = self.store.tickets.get(held.ticket_id) if held is not None and held.ticket_id else None
            if live is not None and live.state in TERMINAL:
                continue          # it ended this moment: the next claim takes the work over
            if held is not None and live is not None:
                self._joined(held.ticket_id, tr, event, action, data, login, delivery)
                return False, held.ticket_id
            # Another scheduler is creating the ticket this very moment (or the row went away, or names
            # a ticket the store does not have: taken over once CLAIM_GRACE_MS has passed): wait for it.
            if time.monotonic() > deadline:
                raise Unavailable(f"the ticket of issue #{key[1]} (Trigger {tr.name}) is being created by another "
                                  "scheduler; deliver the event again later")
            await asyncio.sleep(0.05)

    def _joined(self, ticket_id: str, tr: Trigger, event: str, action: str, data: dict[str, Any], login: str,
                delivery: str) -> None:
        url = _text((data.get("comment") or {}).get("html_url")) or _text((data.get("issue") or {}).get("html_url"))
        self.engine.events.append(ticket_id, JOINED_EVENT, {
            "delivery": delivery, "event": f"{event}.{action}", "author": login, "trigger": tr.name, "url": url})
        self.engine.events.flush()
        log.info("github %s.%s (delivery %s): joined ticket %s of Trigger %s (it is live)", event, action,
                 delivery, ticket_id, tr.name)

    # -- iteration on afe's pull requests (docs/GITHUB.md, "Iteration") ----------

    async def _follow_up(self, tid: str, text: str, *, login: str, source: str, path: str, line: int, url: str,
                         delivery: str, review_id: int, what: str) -> Outcome:
        """Hand a writer's request to the ticket's follow-ups (followups.FollowUpQueue):
        gathered into the coming re-run, or queued for the next one; refused
        only when the ticket can never run again (an event on it says so)."""
        if self.followups is None:      # no engine (an intake that only records deliveries)
            return Outcome("ignored", "not_afe_pull_request")
        try:
            how = self.followups.submit(tid, text, principal=f"github:{login}", author=login, source=source,
                                        path=path, line=line, url=url, delivery=delivery, review_id=review_id)
        except AfeError as exc:
            log.info("%s: no follow-up of ticket %s: %s", what, tid, exc.message)
            return Outcome("ignored", "busy", [tid])
        log.info("%s: follow-up of ticket %s by %s: %s", what, tid, login, how)
        return Outcome("accepted", how, [tid])

    async def _reply_on_pr(self, ticket_id: str, text: str) -> None:
        """A comment on the ticket's pull request (what happened to follow-ups it was sent)."""
        t = self.store.tickets.get(ticket_id)
        pr = self.store.prs.get_pr(ticket_id)
        if t is None or pr is None or t.workspace not in self.config.workspaces:
            return
        await self.credentials.comment(t.workspace, pr.number, text)

    async def _unless_writer(self, ws: Workspace, login: str, where: str, who: str,
                             consequence: str) -> Outcome | None:
        """None when `login` has write access to the workspace's repository
        (R36: only they start work); else the refusal, logged without text."""
        try:
            perm = await self.credentials.repo_permission(ws.name, login)
        except AfeError as exc:
            if isinstance(exc, TRY_AGAIN):
                raise
            log.warning("%s: write access of the sender could not be checked, so nothing was started: %s",
                        where, exc)
            return Outcome("refused", "permission_unknown")
        if perm.can_write:
            return None
        log.info("%s: %s has no write access (%s); %s", where, who, perm.permission or "none", consequence)
        return Outcome("refused", "no_write_access")

    async def _refusal_comment(self, ws: Workspace, number: int, login: str) -> None:
        """At most one polite comment per issue and person, ever (the key is stored first)."""
        key = f"refusal:{ws.forge.repo.lower()}#{number}:{login.lower()}"
        if not self.store.intake.claim_once(key, int(time.time() * 1000)):
            return
        try:
            await self.credentials.comment(ws.name, str(number), REFUSAL_COMMENT)
        except AfeError as exc:
            log.warning("github: the refusal comment on issue #%s could not be posted: %s", number, exc)

    def _create(self, tr: Trigger, ws: Workspace, event: str, action: str, data: dict[str, Any],
                issue: dict[str, Any], login: str, delivery: str) -> str | None:
        comment = data.get("comment") or {}
        command_text = ""
        if event == "issue_comment":
            body = _text(comment.get("body")).lstrip()
            command_text = body[len(tr.command):].strip() if body.startswith(tr.command) else ""
        fields = {
            "title": _text(issue.get("title")),
            "body": _text(issue.get("body")),
            "url": _text(comment.get("html_url")) or _text(issue.get("html_url")),
            "number": str(issue["number"]),
            "author": login,
            "command": command_text,
        }
        sources = {"title": "github:issue.title", "body": "github:issue.body", "url": "github:url",
                   "number": "github:issue.number", "author": "github:sender.login",
                   "command": "github:comment.body"}
        inputs = {name: _clip_utf8(fields[f], MAX_INPUT_BYTES) for name, f in tr.inputs}
        origin = {
            "source": "github", "event": f"{event}.{action}", "delivery_id": delivery, "url": fields["url"],
            "issue": fields["number"],
            "author": login, "trigger": tr.name, "title_untrusted": True, "body_untrusted": True,
            "inputs": [{"name": name, "source": sources[f], "untrusted": True} for name, f in tr.inputs],
        }
        title = f"#{fields['number']} {fields['title']}".strip()[:MAX_TITLE_CHARS]
        body = _clip_utf8(fields["body"], MAX_BODY_BYTES)
        try:
            view: TicketView = self.engine.create_ticket(ws.name, tr.workflow, title, body, inputs,
                                                         f"github:{login}", origin=origin)
        except AfeError as exc:
            log.warning("github %s.%s (delivery %s): Trigger %s could not create a ticket: %s",
                        event, action, delivery, tr.name, exc)
            return None
        log.info("github %s.%s (delivery %s): Trigger %s created ticket %s", event, action, delivery, tr.name,
                 view.ticket.id)
        return view.ticket.id
