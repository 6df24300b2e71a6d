"""The pre-flight check of the store AFE_DATABASE_URL names, for `afe up` and
`afe check`: reachable, and its schema one this afe can use (nothing is
created or migrated). The check is the scheduler's own
(services/scheduler/store/schemacheck.py), run as a child process with the
environment the scheduler gets for its store, so the entry points use the
scheduler as a process, never as a library. Its answer is one JSON object;
an error comes back as the AfeError class it was, its message redacted."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping

from services.common import errors
from services.common.config.database_url import ENV
from services.common.errors import AfeError, FailedPrecondition
from services.common.layout import Layout
from services.common.secrecy.childenv import BASE_NAMES, DEFAULT_PATH
from services.common.secrecy.redact import Redactor

SCHEMA_CHECK = "services.scheduler.store.schemacheck"
TIMEOUT_S = 120     # a PostgreSQL connect gives up after 10 s (services/common/config/database_url.py)


def check_store(layout: Layout, environ: Mapping[str, str], python: str = sys.executable) -> str:
    """The line `afe check` shows for the store, or the AfeError (redacted) saying what to change."""
    redactor = Redactor([environ[ENV]] if environ.get(ENV) else [])
    env = {n: environ[n] for n in (*BASE_NAMES, ENV) if n in environ}
    env.setdefault("PATH", DEFAULT_PATH)
    try:
        r = subprocess.run([python, "-m", SCHEMA_CHECK, "--data", str(layout.data_dir), "--run", str(layout.run_dir)],
                           capture_output=True, text=True, env=env, check=False, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FailedPrecondition(f"the check of the store ({ENV}) gave no answer in {TIMEOUT_S}s") from None
    try:
        answer = json.loads(r.stdout.strip().splitlines()[-1])
        line, error, message = answer.get("line"), answer.get("error"), answer.get("message", "")
    except (ValueError, IndexError, AttributeError):
        tail = redactor.redact(r.stderr.strip()[-400:]) or f"exit status {r.returncode}"
        raise FailedPrecondition(f"the check of the store ({ENV}) failed: {tail}") from None
    if isinstance(error, str):
        cls = getattr(errors, error, None)
        if not (isinstance(cls, type) and issubclass(cls, AfeError)):
            cls = FailedPrecondition
        raise cls(redactor.redact(str(message)))
    return str(line)
