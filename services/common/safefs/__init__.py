"""Symlink-safe file system code for trees the sandbox writes (R17-R19, R34).

Both brokers act on directories an untrusted sandbox controls: the sandbox
broker's file tools and ownership fix-up, the credential broker's commit
snapshot, hand-over and removal. All of it goes through this package:

- `open`: checked relative paths (`split_relative`, `RelPath`) and opening
  one component at a time from a directory fd with `O_NOFOLLOW`
  (`open_dir_at`, `open_regular`, their quiet `..._or_none` forms, `DirCache`).
- `root`: `Root`, an open directory and the operations on paths under it
  (read, write, list, stat, remove, mkdir, walk, chown), like Go's `os.Root`.
- `walk`: the iterative, bounded, no-follow walk (`walk`, `Limits`,
  `TreeTooLarge`) and `disk_usage`.
- `own`: the one ownership fix-up (`chown_tree_at`, `chown_tree`).
- `remove`: removal of any depth (`empty_dir`, `remove_tree`).
- `copy`: `copy_tree`, links copied as links.

Tested as a table in tests/foundation/test_safefs.py.
"""

from .copy import copy_tree
from .open import (
    DIR_FLAGS,
    FILE_FLAGS,
    MAX_COMPONENT,
    MAX_DEPTH,
    MAX_PATH,
    DirCache,
    RelPath,
    changed_during_call,
    classify_open_error,
    open_dir_at,
    open_dir_or_none,
    open_regular,
    open_regular_or_none,
    show,
    split_relative,
)
from .own import chown_tree, chown_tree_at, own_at, own_fd
from .remove import empty_dir, remove_dirs_except, remove_tree
from .root import Root
from .walk import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_ENTRIES,
    Item,
    Limits,
    TreeTooLarge,
    disk_usage,
    list_names,
    walk,
)

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "DEFAULT_MAX_ENTRIES",
    "DIR_FLAGS",
    "FILE_FLAGS",
    "MAX_COMPONENT",
    "MAX_DEPTH",
    "MAX_PATH",
    "DirCache",
    "Item",
    "Limits",
    "RelPath",
    "Root",
    "TreeTooLarge",
    "changed_during_call",
    "chown_tree",
    "chown_tree_at",
    "classify_open_error",
    "copy_tree",
    "disk_usage",
    "empty_dir",
    "list_names",
    "open_dir_at",
    "open_dir_or_none",
    "open_regular",
    "open_regular_or_none",
    "own_at",
    "own_fd",
    "remove_dirs_except",
    "remove_tree",
    "show",
    "split_relative",
    "walk",
]
