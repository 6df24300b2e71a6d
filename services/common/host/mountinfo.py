"""The mount table, read from /proc/self/mountinfo: what is mounted where
(the sandbox broker's disk caps, and the launcher's list of what an earlier
`afe up` left mounted)."""

from __future__ import annotations

from dataclasses import dataclass


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit() and len(field[i + 1:i + 4]) == 3:
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


@dataclass(frozen=True)
class Mount:
    target: str
    fstype: str
    source: str


def mounts() -> list[Mount]:
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            lf, rf = left.split(), right.split()
            if len(lf) >= 5 and len(rf) >= 2:
                found.append(Mount(_unescape(lf[4]), rf[0], _unescape(rf[1])))
    return found
