"""`python -m services.scheduler.store.schemacheck --data DIR --run DIR`: the
store AFE_DATABASE_URL names, reached and its schema compared with this
afe's, changing nothing (`url.check_database`). The pre-flight checks of
`afe check` and `afe up` run it as a child (services/launcher/storecheck.py),
so the entry points never load the scheduler's code.

It prints one JSON object on stdout: `{"line": ...}` (what `afe check`
shows) or `{"error": <AfeError class name>, "message": ...}` (redacted: the
URL and its password never appear); the exit status is 0 either way."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from services.common.config.database_url import ENV, read_database_url
from services.common.errors import AfeError
from services.common.layout import Layout
from services.common.secrecy.redact import Redactor

from .url import check_database


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.scheduler.store.schemacheck")
    p.add_argument("--data", required=True)
    p.add_argument("--run", required=True)
    args = p.parse_args(argv)
    environ = dict(os.environ)
    redactor = Redactor([environ[ENV]] if environ.get(ENV) else [])
    answer: dict[str, str]
    try:
        answer = {"line": check_database(read_database_url(Layout(Path(args.data), Path(args.run)),
                                                           redactor, environ))}
    except AfeError as exc:
        answer = {"error": type(exc).__name__, "message": redactor.redact(str(exc))}
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
