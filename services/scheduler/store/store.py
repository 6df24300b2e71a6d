"""The store: the scheduler's durable state as one repository per aggregate,
over one database (SQLite or PostgreSQL, the same statements).

    store.tickets       tickets and node runs                 (tickets.py)
    store.events        a ticket's events                     (events.py)
    store.leases        leases and fences (R37, R45)          (leases.py)
    store.approvals     a person's decisions                  (repos/approvals.py)
    store.prs           pull requests                         (repos/pull_requests.py)
    store.diffs         final diffs                           (repos/final_diffs.py)
    store.reports       reports back to GitHub                (repos/reports.py)
    store.intake        GitHub once-keys, cursors, work       (repos/github_intake.py)
    store.followups     follow-ups                            (repos/followups.py)
    store.ci            failing CI rounds                     (repos/ci_failures.py)
    store.verifications clean-room verdicts (R41)             (repos/verifications.py)
    store.run_records   signed run records (R42)              (repos/run_records.py)
    store.placements    sandbox placements                    (repos/placements.py)

Every repository writes a ticket this scheduler holds only after checking its
fence in the write's own transaction (`Leases.guard`), and each public method
runs under the database's retrier (a transaction redone whole after a lost
or busy database). In the scheduler the store runs on its own thread
(worker.py `ThreadedStore`, which has the same shape).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Connection

from .database import Database, retry_methods
from .events import Events
from .leases import Leases
from .migrate import migrate
from .repos import (
    Approvals,
    CiFailures,
    FinalDiffs,
    FollowUps,
    GitHubIntake,
    PullRequests,
    Reports,
    RunRecords,
    SandboxPlacements,
    Verifications,
)
from .tickets import Tickets

# The repositories of a store, by attribute (ThreadedStore puts each on the store's thread).
REPOSITORIES = ("tickets", "events", "leases", "approvals", "prs", "diffs", "reports", "intake", "followups", "ci",
                "verifications", "run_records", "placements")


class Store:
    """The repositories over one database. `shared`: several schedulers may use
    this database at once (PostgreSQL); on SQLite one scheduler owns it."""

    tickets: Tickets
    events: Events
    leases: Leases
    approvals: Approvals
    prs: PullRequests
    diffs: FinalDiffs
    reports: Reports
    intake: GitHubIntake
    followups: FollowUps
    ci: CiFailures
    verifications: Verifications
    run_records: RunRecords
    placements: SandboxPlacements

    def __init__(self, db: Database, owner: str = "") -> None:
        self.db = db
        self.shared = db.dialect == "postgresql"
        self._retry = db.retry          # worker.py hooks its waits and health reports here
        leases = Leases(db, owner, exclusive=not self.shared)
        check = leases.guard

        def tx() -> AbstractContextManager[Connection]:
            return db.transaction(write=True)

        def read() -> AbstractContextManager[Connection]:
            return db.transaction()

        repos: dict[str, Any] = {
            "tickets": Tickets(db, leases), "events": Events(db, leases), "leases": leases,
            "approvals": Approvals(tx, read=read), "prs": PullRequests(tx, check, read=read),
            "diffs": FinalDiffs(tx, check, read=read), "reports": Reports(tx, check, read=read),
            "intake": GitHubIntake(tx, check, read=read), "followups": FollowUps(tx, check, read=read),
            "ci": CiFailures(tx, check, read=read), "verifications": Verifications(tx, check, read=read),
            "run_records": RunRecords(tx, check, read=read), "placements": SandboxPlacements(tx, check, read=read),
        }
        for name, repo in repos.items():
            setattr(self, name, retry_methods(repo, db.retry))

    @classmethod
    def sqlite(cls, path: str | os.PathLike[str], owner: str = "") -> Store:
        """The embedded store in `path`, migrated to this afe's schema."""
        db = Database.sqlite(path)
        try:
            migrate(db)
        except BaseException:
            db.close()
            raise
        return cls(db, owner)

    @classmethod
    def postgresql(cls, conninfo: str, where: str, owner: str = "") -> Store:
        """The store in the PostgreSQL database `conninfo` names (never logged: `where`
        names it in messages), migrated to this afe's schema."""
        db = Database.postgresql(conninfo, where)
        try:
            migrate(db)
        except BaseException:
            db.close()
            raise
        return cls(db, owner)

    def __repr__(self) -> str:
        return f"Store({self.db.where})"

    @property
    def where(self) -> str:
        return self.db.where

    @property
    def path(self) -> Path | None:
        """The SQLite store's file (None on PostgreSQL)."""
        return self.db.path

    @property
    def owner(self) -> str:
        """This scheduler's id, the owner of its leases."""
        return self.leases.owner

    @owner.setter
    def owner(self, value: str) -> None:
        self.leases.owner = value

    def ping(self) -> bool:
        """Whether the database answers now (readiness); never retried."""
        return self.db.ping()

    def checkpoint(self) -> None:
        self.db.checkpoint()

    def close(self) -> None:
        self.db.close()
