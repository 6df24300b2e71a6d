"""Path rules for the host-side file tools (R17-R19).

The rules and the opening live in `services.common.safefs` (safefs/open.py,
safefs/root.py), shared with the credential broker; this module gives them the
sandbox broker's names. A tool path is relative to the workspace root:
`split_relative` refuses absolute paths, `..`, `.`, NUL bytes and empty
components, and `Root` opens every component from the workspace's directory
fd with `O_NOFOLLOW`, so a symlink anywhere on the path -- including one the
sandbox swaps in while a call is in progress -- makes the open fail instead
of being followed.
"""

from __future__ import annotations

from services.common import safefs

MAX_PATH = safefs.MAX_PATH
MAX_COMPONENT = safefs.MAX_COMPONENT
MAX_DEPTH = safefs.MAX_DEPTH
DIR_FLAGS = safefs.DIR_FLAGS

show = safefs.show
split_relative = safefs.split_relative
open_dir_at = safefs.open_dir_at
changed_during_call = safefs.changed_during_call


class Root(safefs.Root):
    """A ticket's workspace root (see `safefs.Root`)."""

    MISSING = "the ticket's workspace does not exist: create the sandbox first"
