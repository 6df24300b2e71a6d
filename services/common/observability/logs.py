"""Logging for every process: one JSON object a line (text on a TTY), the
redacting filter on every handler, and the ticket id carried by a context
variable (logs may name a ticket; metric labels may not)."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import TextIO

from services.common.secrecy.redact import RedactingFilter, Redactor

ticket_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("afe_ticket", default=None)


class _ContextFilter(logging.Filter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def filter(self, record: logging.LogRecord) -> bool:
        record.afe_process = self.process
        record.afe_ticket = ticket_var.get()
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "process": getattr(record, "afe_process", None),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        ticket = getattr(record, "afe_ticket", None)
        if ticket:
            out["ticket"] = ticket
        if record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ticket = getattr(record, "afe_ticket", None)
        head = time.strftime("%H:%M:%S", time.localtime(record.created))
        where = getattr(record, "afe_process", "") or ""
        line = f"{head} {record.levelname[:4]} {where}{' ' + ticket if ticket else ''} {record.getMessage()}"
        if record.exc_text:
            line += "\n" + record.exc_text
        return line


def setup_logging(process: str, redactor: Redactor, *, level: str = "INFO", stream: TextIO | None = None,
                  json_format: bool | None = None) -> None:
    """Install the formatter and the redacting filter on the root logger."""
    stream = stream or sys.stderr
    if json_format is None:
        json_format = not (hasattr(stream, "isatty") and stream.isatty())
    handler = logging.StreamHandler(stream)
    handler.addFilter(_ContextFilter(process))
    handler.addFilter(RedactingFilter(redactor))
    handler.setFormatter(JsonFormatter() if json_format else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Libraries that could log request headers stay quiet below WARNING.
    for noisy in ("aiohttp.access", "urllib3", "docker", "grpc", "opentelemetry"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
