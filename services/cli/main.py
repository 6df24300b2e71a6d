"""The `afe` command: a thin dispatcher. Each verb lives in its own module
under services/cli/ exposing `add_parser(subparsers)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# verb -> module. A module may register several verbs (e.g. `ticket`, `approve`).
VERBS: dict[str, str] = {
    "up": "services.cli.up",
    "check": "services.cli.check",
    "init": "services.cli.init",
    "images": "services.cli.images",
    "doctor": "services.cli.doctor",
    "ticket": "services.cli.tickets",
    "approve": "services.cli.tickets",
    "reject": "services.cli.tickets",
    "token": "services.cli.token",
    "certs": "services.cli.certs",
    "keys": "services.cli.verify",
    "verify": "services.cli.verify",
}

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afe",
        description="afe turns tickets into reviewed pull requests. Run `afe up` to start it.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    seen: set[str] = set()
    for module_name in dict.fromkeys(VERBS.values()):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        if module_name not in seen:
            module.add_parser(sub)
            seen.add(module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`afe ticket watch ID | head`): stop quietly, as other Unix tools do.
        # Python would flush stdout again at exit and fail once more: point it at /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141   # 128 + SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
