"""What every benchmark module returns. `make bench` (bench/run.py) imports
each `bench/bench_*.py`, calls its `run(out_dir)` and writes the report.

Figures are ratios against a baseline measured in the same run, never
absolute timings compared with constants.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Result:
    issue: int            # the issue that sets the target
    name: str             # what was measured
    baseline: str         # what it was compared with
    measured_s: float     # our figure (seconds, or per-op seconds)
    baseline_s: float     # the baseline's figure, same unit
    target: float | None  # the ratio to meet; None: reported beside a target row, with none of its own
    higher_is_better: bool = False   # True for throughput-style ratios
    notes: str = ""

    @property
    def ratio(self) -> float:
        if self.higher_is_better:
            return self.measured_s / self.baseline_s if self.baseline_s else float("inf")
        return self.measured_s / self.baseline_s if self.baseline_s else float("inf")

    @property
    def met(self) -> bool:
        if self.target is None:
            return True
        return self.ratio >= self.target if self.higher_is_better else self.ratio <= self.target


@dataclass(frozen=True)
class Section:
    """A part of the report of its own, after the table: markdown, the
    images (file names in the report folder) the module wrote, and the
    problems it found (a checked property that did not hold: the module is
    then reported as failed, with its figures kept)."""
    title: str
    body: str                        # markdown
    images: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()


def median_time(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
