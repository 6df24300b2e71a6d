"""The tree walks of R34, under the names docs/SECURITY.md and older callers use.

The code lives in `services.common.safefs` (walk.py, remove.py, own.py);
new code imports it from there.
"""

from __future__ import annotations

from . import safefs

DIR_FLAGS = safefs.DIR_FLAGS
DEFAULT_MAX_DEPTH = safefs.DEFAULT_MAX_DEPTH
DEFAULT_MAX_ENTRIES = safefs.DEFAULT_MAX_ENTRIES
Limits = safefs.Limits
Item = safefs.Item
TreeTooLarge = safefs.TreeTooLarge
open_dir_at = safefs.open_dir_or_none
list_names = safefs.list_names
walk = safefs.walk
chown_tree_at = safefs.chown_tree_at
empty_dir = safefs.empty_dir
remove_tree = safefs.remove_tree
