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
