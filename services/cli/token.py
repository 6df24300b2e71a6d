"""`afe token rotate`: write a new random UI token (0600), or with
`--automation` a new automation key.

The gateway watches the token file: the moment it changes, every session
cookie stops verifying (the cookie key is derived from the token) and every
open /rpc connection made with the old token is closed.

The scheduler follows `<run>/automation.key` (services/scheduler/automation_key.py):
within a second of a rotation, calls presenting the old key get
PERMISSION_DENIED.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sys
from pathlib import Path

from services.common.layout import Layout

EXIT_OK = 0
EXIT_FAILED = 1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("token", help="manage the UI token",
                       description="Manage the UI token the gateway accepts (web login and the CLI's bearer).")
    tsub = p.add_subparsers(dest="token_verb", metavar="ACTION", required=True)
    r = tsub.add_parser("rotate", help="write a new random token; every session ends at once",
                        description="Write a new random UI token to <data>/ui-token (mode 0600). A running "
                        "gateway notices within a second: every browser session and every /rpc connection "
                        "made with the old token ends. The CLI reads the new file on its next call.")
    r.add_argument("--data", default=".afe/data", help="data folder (default: .afe/data)")
    r.add_argument("--automation", action="store_true",
                   help="rotate the automation key (<run>/automation.key, the key gRPC automation presents to "
                   "the scheduler) instead of the UI token; needs a running `afe up`")
    r.add_argument("--run", default=None, help="runtime folder (default: the data folder's sibling `run`)")
    r.add_argument("--print", dest="print_token", action="store_true",
                   help="print the new token on stdout (nothing else) so a script can capture it")
    r.set_defaults(func=run_rotate)


def run_rotate(args: argparse.Namespace) -> int:
    if getattr(args, "automation", False):
        return _rotate_automation(args)
    from services.common.secrecy.tokenfile import write_token_file

    path = Layout.from_args(args.data).token_file
    try:
        token = write_token_file(path)
    except OSError as exc:
        print(f"afe token rotate: cannot write {path}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED
    if args.print_token:
        print(token)
    else:
        print(f"wrote a new UI token to {path} (mode 0600); sessions using the old token have ended.\n"
              f"Log in again with the token in that file.", file=sys.stderr)
    return EXIT_OK


def _rotate_automation(args: argparse.Namespace) -> int:
    path = Layout.from_args(args.data, args.run).automation_key
    if not path.exists():
        print(f"afe token rotate: there is no automation key at {path}; it exists only while `afe up` runs "
              f"with that runtime folder (pass --run DIR or --data DIR to point at it)", file=sys.stderr)
        return EXIT_FAILED
    key = secrets.token_bytes(32).hex()
    try:
        _write_private(path, (key + "\n").encode())
    except OSError as exc:
        print(f"afe token rotate: cannot write {path}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED
    if args.print_token:
        print(key)
    else:
        print(f"wrote a new automation key to {path} (mode 0600); within a second the scheduler refuses the "
              f"old one. Automation reads the new key from that file.", file=sys.stderr)
    return EXIT_OK


def _write_private(path: Path, data: bytes) -> None:
    """Replace `path` atomically with a 0600 file holding `data`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
