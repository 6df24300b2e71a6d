"""A guard for pytest-xdist 3.8's load-file scheduler after a worker crash.

When a worker dies (a segmentation fault, an abort), xdist starts a replacement. If
the replacement's collection differs from the first workers' (a test collected only
when some file exists, say), xdist 3.8 keeps the replacement out of its collections
but still hands it work, and the whole run ends in INTERNALERROR (KeyError
WorkerController) with the rest of the suite never run and no summary
(pytest-dev/pytest-xdist#1189, #1299). With this guard the replacement gets no work:
the other workers finish the suite, and the crashed test is reported as failed.
"""

from __future__ import annotations

from typing import Any


def install() -> bool:
    """Patch the scheduler once (the controller process only needs it); False when xdist is absent."""
    try:
        from xdist.scheduler.loadscope import LoadScopeScheduling
    except ImportError:
        return False
    if getattr(LoadScopeScheduling, "_afe_restart_guard", False):
        return True
    original = LoadScopeScheduling._reschedule

    def _reschedule(self: Any, node: Any) -> None:
        if node not in self.registered_collections:
            return          # a replacement whose collection was refused: no work for it
        original(self, node)

    LoadScopeScheduling._reschedule = _reschedule  # type: ignore[method-assign]
    LoadScopeScheduling._afe_restart_guard = True  # type: ignore[attr-defined]
    return True
