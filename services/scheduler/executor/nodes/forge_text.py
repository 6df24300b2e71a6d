"""Text that becomes git and forge data: a commit's message, a pull request's
title and body (builtins.py, `builtin:commit` and `builtin:open_pr`).

They are rendered from the workflow's templates, by default from the
ticket's title and body, which may come from outside (a GitHub issue's
title, R36: data, never code). Such text can hold control characters: git
refuses a commit message with a NUL ("a NUL byte in commit log message not
allowed"), so an issue titled that way failed its ticket at `open_pr`, and
an escape sequence (ESC [ ...) would reach the terminal of everyone who
runs `git log` or lists the pull requests. So every control character but
line feed and tab (Unicode category Cc: C0, DEL, C1) is taken out here, a
line break kept as LF; a pull request's title is one line.
"""

from __future__ import annotations

import re

# Cc but tab (\x09) and line feed (\x0a); a carriage return of CRLF goes with the rest.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
TITLE_CHARS = 256       # GitHub's longest pull request title


def _lines(text: str) -> str:
    return _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


def commit_message(text: str) -> str:
    """A commit message: lines kept, control characters out (the broker adds a default when empty)."""
    return _lines(text).strip()


def pr_title(text: str) -> str:
    """A pull request's title: one line, control characters out, runs of white space one space."""
    return " ".join(_lines(text).split())[:TITLE_CHARS]


def pr_body(text: str) -> str:
    """A pull request's description: lines kept, control characters out."""
    return _lines(text)
