"""`afe token rotate`: write a new random UI token (0600).

The gateway watches the token file: the moment it changes, every session
cookie stops verifying (the cookie key is derived from the token) and every
open /rpc connection made with the old token is closed.
"""

from __future__ import annotations

import argparse
import sys

from services.common.layout import Layout

EXIT_OK = 0
EXIT_FAILED = 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("token", help="manage the UI token",
                       description="Manage the UI token the gateway accepts (web login and the CLI's bearer).")
    tsub = p.add_subparsers(dest="token_verb", metavar="ACTION", required=True)
    r = tsub.add_parser("rotate", help="write a new random token; every session ends at once",
                        description="Write a new random UI token to <data>/ui-token (mode 0600). A running "
                        "gateway notices within a second: every browser session and every /rpc connection "
                        "made with the old token ends. The CLI reads the new file on its next call.")
    r.add_argument("--data", default=".afe/data", help="data folder (default: .afe/data)")
    r.add_argument("--print", dest="print_token", action="store_true",
                   help="print the new token on stdout (nothing else) so a script can capture it")
    r.set_defaults(func=run_rotate)


def run_rotate(args: argparse.Namespace) -> int:
    from gateway.tokens import write_token_file

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
