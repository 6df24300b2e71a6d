"""Where things live. One object, built from --data/--run, passed to whoever
needs a path; nothing else composes these paths by hand."""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from .errors import FailedPrecondition, InvalidArgument

# Ticket ids double as workspace handles, Docker label values, network names
# and branch suffixes, so they are kept to a safe alphabet.
TICKET_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")

DEFAULT_PORTS = {
    "gateway": 8420,        # the UI and /rpc
    "scheduler_ops": 9461,
    "sandbox_ops": 9462,
    "credentials_ops": 9463,
    "gateway_ops": 9464,
}


def check_ticket_id(ticket_id: str) -> str:
    if not isinstance(ticket_id, str) or not TICKET_ID_RE.match(ticket_id):
        raise InvalidArgument("ticket id must be 1-63 characters of a-z, 0-9 and '-'")
    return ticket_id


# An instance id (`afe up --instance`, `<data>/instance`) labels every container and network
# of one deployment (afe.instance): the sandbox broker's and the launcher's.
INSTANCE_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,39}$")


def check_instance(instance: str) -> str:
    if not INSTANCE_RE.match(instance or ""):
        raise InvalidArgument("--instance must be 1-40 characters of a-z, 0-9, '_', '.', '-'")
    return instance


@dataclass(frozen=True)
class Layout:
    data_dir: Path
    run_dir: Path

    @classmethod
    def from_args(cls, data: str | os.PathLike[str] | None,
                  run: str | os.PathLike[str] | None = None) -> Layout:
        data_dir = Path(data or ".afe/data").absolute()
        run_dir = Path(run).absolute() if run else data_dir.parent / "run"
        return cls(data_dir, run_dir)

    def socket(self, service: str) -> Path:
        return self.run_dir / f"{service}.sock"

    @property
    def automation_key(self) -> Path:
        """0600 file holding the secret local automation presents to the scheduler."""
        return self.run_dir / "automation.key"

    @property
    def store_file(self) -> Path:
        return self.data_dir / "afe.db"

    @property
    def token_file(self) -> Path:
        return self.data_dir / "ui-token"

    @property
    def workspaces_dir(self) -> Path:
        return self.data_dir / "workspaces"

    def workspace(self, ticket_id: str) -> Path:
        return self.workspaces_dir / check_ticket_id(ticket_id)

    @property
    def gitdirs_dir(self) -> Path:
        return self.data_dir / "git"

    def gitdir(self, ticket_id: str) -> Path:
        return self.gitdirs_dir / f"{check_ticket_id(ticket_id)}.git"

    @property
    def mirrors_dir(self) -> Path:
        return self.data_dir / "mirrors"

    @property
    def relays_dir(self) -> Path:
        """The model relays' sockets (R32), one folder per ticket."""
        return self.run_dir / "relay"

    def relay_dir(self, ticket_id: str) -> Path:
        """The ticket's relay folder: the credential broker serves its socket
        here, the sandbox broker mounts it read-only into the ticket's sandbox."""
        return self.relays_dir / check_ticket_id(ticket_id)

    @property
    def forges_dir(self) -> Path:
        """State of the `local` forge (PR records)."""
        return self.data_dir / "forge"

    def ensure(self) -> None:
        made = [_first_missing(self.data_dir), _first_missing(self.run_dir)]
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Keys, tokens and the store must never reach a commit of the repository
        # afe runs in: `.afe/` (the default's parent, also of an older afe) is
        # ignored as a whole, and so is any other folder afe made for itself.
        for folder, top in ((self.data_dir, made[0]), (self.run_dir, made[1])):
            if folder.parent.name == STATE_FOLDER:
                keep_out_of_git(folder.parent)
            elif top is not None:
                keep_out_of_git(top)
        # Ours is made private. A shared runtime dir made by the deployment
        # (deploy/systemd: /run/afe owned by root, not writable by others, one
        # user per process) is left as it is; anything else is refused.
        st = self.run_dir.stat()
        if st.st_uid == os.geteuid():
            os.chmod(self.run_dir, 0o700)
        elif st.st_uid != 0 or st.st_mode & 0o022:
            raise FailedPrecondition(f"the runtime folder {self.run_dir} belongs to another user; "
                                     "use a folder of your own (--run DIR)")


STATE_FOLDER = ".afe"     # the default home of --data and --run, in the folder `afe up` starts in
GITIGNORE = b"# afe's state: signing key, UI token, automation key, the store. Never commit it.\n*\n"


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what a mkdir -p makes), or None."""
    top = None
    while not path.exists():
        top, path = path, path.parent
    return top


def keep_out_of_git(folder: Path) -> None:
    """Write `folder/.gitignore` ignoring everything in the folder, itself included, so
    `git add -A` in a repository holding it stages nothing of it. A `.gitignore`
    already there (the user's own, or ours) is left as it is."""
    try:
        fd = os.open(folder / ".gitignore", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        return
    except OSError:     # a folder we may not write to is its owner's to look after
        return
    try:
        os.write(fd, GITIGNORE)
    finally:
        os.close(fd)


# The uid:gid every sandbox runs as (R7): never root, never the brokers' own.
# Workspace files are owned by it so the sandbox can write them; host tools
# and host git work on them regardless.
SANDBOX_UID = 10001
SANDBOX_GID = 10001


def new_ticket_id() -> str:
    """A new ticket id: `t-` and 12 random hex digits (matches TICKET_ID_RE)."""
    return "t-" + secrets.token_hex(6)


VERIFY_SUFFIX = "-verify"


def verify_id(ticket_id: str) -> str:
    """The id of a ticket's clean-room verification (R41): its sandbox and its workspace folder
    are `<ticket>-verify`, named so by the scheduler and the credential broker alike."""
    return ticket_id + VERIFY_SUFFIX


def verify_owner(sandbox_id: str) -> str:
    """The ticket whose verification `sandbox_id` is ("" for any other id)."""
    return sandbox_id[:-len(VERIFY_SUFFIX)] if sandbox_id.endswith(VERIFY_SUFFIX) else ""
