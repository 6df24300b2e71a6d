"""What the pool's gauges report (`afe_sandbox_pool_wanted`, `..._ready`),
from the configuration alone: no Docker, no broker is called."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.common.config.manifests import load_config
from services.common.observability.metrics import scheduler_metrics
from services.scheduler.sandboxes.pool import SandboxPool
from tests.scheduler.conftest import write_config

WORKFLOWS = """\
kind: Workflow
name: a
workspace: ws
nodes:
  - {id: a, run: "true"}
---
kind: Workflow
name: b
workspace: ws
nodes:
  - {id: b, run: "true"}
"""


def _gauges(tmp_path, pool: int, cap: int, marks: bool = True) -> tuple[float, float]:
    config = load_config(write_config(tmp_path, WORKFLOWS, sandbox_extra=f"  pool: {pool}\n"))
    p = SandboxPool(config, None, None, tmp_path / "pool" if marks else None, cap=cap,  # type: ignore[arg-type]
                    is_ticket=lambda _tid: False)
    registry = CollectorRegistry()
    p.export(scheduler_metrics(registry))
    return (registry.get_sample_value("afe_sandbox_pool_wanted"),
            registry.get_sample_value("afe_sandbox_pool_ready"))


def test_wanted_is_the_workspace_pool_per_profile_at_most_the_cap(tmp_path):
    # two workflows of one workspace with the same sandbox: one profile of 3
    assert _gauges(tmp_path / "a", pool=3, cap=8) == (3, 0)
    assert _gauges(tmp_path / "b", pool=3, cap=2) == (2, 0)      # the global cap holds
    # no pool asked for, a cap of 0, or no place to mark reserved ids: nothing wanted
    assert _gauges(tmp_path / "c", pool=0, cap=8) == (0, 0)
    assert _gauges(tmp_path / "d", pool=3, cap=0) == (0, 0)
    assert _gauges(tmp_path / "e", pool=3, cap=8, marks=False) == (0, 0)
