"""How a clean-room verification's result (R41, the `verification.finished`
payload) reads for people: one line shared by the merge refusal, the
commit status on GitHub and the CLI. Commands are the manifest's templates
(operator text), shown as inline code with backticks and line breaks removed."""

from __future__ import annotations

from typing import Any


def failure_line(result: dict[str, Any]) -> str:
    """"verification failed: `CMD` exited 1 (tests/ from main)", "verification failed: ran no
    test (...)" (a rule of R41 beyond exit codes, the first of `reasons`) — or passed."""
    paths = result.get("base_paths") or []
    where = f" ({', '.join(paths)} from {result.get('base_branch') or 'the base branch'})" if paths else ""
    commands = result.get("commands") or []
    if result.get("passed"):
        return f"verification passed: {len(commands)} command{'s' if len(commands) != 1 else ''}{where}"
    failed = next((c for c in commands if c.get("exit_code") != 0 or c.get("timed_out")), None)
    reasons = [str(r) for r in result.get("reasons") or []]
    if failed is None and reasons:
        return f"verification failed: {code(reasons[0], 300)}{where}"
    if failed is None:
        return "verification did not run" + where
    how = "timed out" if failed.get("timed_out") else f"exited {failed.get('exit_code')}"
    return f"verification failed: `{code(str(failed.get('command') or ''))}` {how}{where}"


def code(text: str, limit: int = 200) -> str:
    """`text` fit for inline code: no backtick, no line break, bounded."""
    return "".join(ch for ch in text[:limit] if ch not in "`\r\n")


def shown(text: str, limit: int = 200) -> str:
    """A name from the head (a file path: anything but NUL and `/` may be in it) fit for a
    terminal or a comment: control characters and backticks as escapes, bounded."""
    out = []
    for ch in text[:limit]:
        if ch == "`":
            out.append("\\x60")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out) + ("…" if len(text) > limit else "")


def _names(items: Any, limit: int = 10) -> str:
    names = [shown(str(i)) for i in (items or [])]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def counts_text(counts: Any) -> str:
    """"5 passed, 1 failed, 2 deselected" of a command's or a run's test counts ("" without)."""
    if not isinstance(counts, dict):
        return ""
    parts = [f"{counts.get(k)} {k}" for k in ("passed", "failed", "errors", "skipped", "deselected",
                                              "xfailed", "xpassed") if counts.get(k)]
    return ", ".join(parts) or "no test ran"


def detail_lines(result: dict[str, Any]) -> list[str]:
    """What a reviewer reads of a verification beyond its one line: the base it was merged onto,
    each command with its exit status and test counts, why it failed, what the head changes in
    how tests run, its binary files and shadowing names."""
    lines = []
    if result.get("base_sha"):
        lines.append(f"merged onto {shown(str(result.get('base_branch') or 'the base branch'))} at "
                     f"{str(result.get('base_sha'))[:12]}")
    for c in result.get("commands") or []:
        how = "timed out" if c.get("timed_out") else f"exit {c.get('exit_code')}"
        ran = counts_text(c.get("counts"))
        lines.append(f"`{code(str(c.get('command') or ''))}`: {how}" + (f", {ran}" if ran else ""))
    tests, base = result.get("tests"), result.get("base_tests")
    if isinstance(tests, dict):
        lines.append(f"tests ran: {tests.get('ran', 0)}"
                     + (f" (the base's own run: {base.get('ran', 0)})" if isinstance(base, dict) else ""))
    for r in result.get("reasons") or []:
        lines.append(f"failed: {code(str(r), 400)}")
    if result.get("harness_changes"):
        lines.append("this head changes how tests run: " + _names(result["harness_changes"])
                     + " (the verification used the base's; approving needs --accept-harness-change)")
    if result.get("shadowing"):
        lines.append("top-level names that shadow a module the commands run (left out): "
                     + _names(result["shadowing"]))
    if result.get("binary_files"):
        lines.append("binary files: " + _names(result["binary_files"]))
    return lines
