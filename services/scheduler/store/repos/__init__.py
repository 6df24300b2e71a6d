"""The store's record repositories, each a small class owning its statements,
written once for SQLite and PostgreSQL (SQLAlchemy Core on the tables of
store/schema.py). Each takes a `Transaction` (how to open one) and, when it
writes an owner's ticket data, a `FenceCheck` run in the write's own
transaction (base.py).

- approvals.py: `Approvals` (a person's decisions; unfenced requests)
- pull_requests.py: `PullRequests` (the ticket's PR; the ticket of a PR number or head)
- final_diffs.py: `FinalDiffs` (a ticket's diff kept after it ended)
- reports.py: `Reports` (what was last reported on GitHub, per ticket and step)
- github_intake.py: `GitHubIntake` (once-keys, poll cursors, work claims)
- followups.py: `FollowUps` (add, give, drop; the CI rounds' drop)
- ci_failures.py: `CiFailures` (one CI round per ticket and head; the heads polling watches)
- verifications.py: `Verifications` (clean-room verdicts, R41)
- run_records.py: `RunRecords` (signed run records, R42)
- placements.py: `SandboxPlacements` (which sandbox broker holds a ticket's sandbox)
"""

from .approvals import Approvals
from .base import FenceCheck, FencedRepository, Repository, Transaction
from .ci_failures import CiFailures
from .final_diffs import FinalDiffs
from .followups import FollowUps
from .github_intake import GitHubIntake
from .placements import SandboxPlacements
from .pull_requests import PullRequests
from .reports import Reports
from .run_records import RunRecords
from .verifications import Verifications

__all__ = ["Approvals", "CiFailures", "FenceCheck", "FencedRepository", "FinalDiffs", "FollowUps", "GitHubIntake",
           "PullRequests", "Reports", "Repository", "RunRecords", "SandboxPlacements", "Transaction",
           "Verifications"]
