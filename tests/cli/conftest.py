"""CLI tests run `afe` against the real running system (shared with tests/gateway)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def live_afe():
    from tests.gateway.live import HOLDER

    live = HOLDER.acquire()
    yield live
    HOLDER.release()
