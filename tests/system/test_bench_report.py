"""`make bench` (bench/run.py): every module runs, a failing one is reported
and the rest still run; the report has the table, the chart and the machine."""

from __future__ import annotations

import sys
import textwrap

import pytest

from bench import run as bench_run

OK = '''
from bench.common import Result

def run(out_dir):
    return [Result(issue=3, name="exec round trip", baseline="docker exec CLI", measured_s=0.02,
                   baseline_s=0.05, target=1.0),
            Result(issue=4, name="clone via mirror", baseline="fresh clone", measured_s=0.9,
                   baseline_s=0.3, target=0.5, notes="cold cache"),
            Result(issue=5, name="events per second", baseline="raw inserts", measured_s=4000.0,
                   baseline_s=8000.0, target=0.4, higher_is_better=True),
            Result(issue=5, name="clone, cold cache", baseline="fresh clone", measured_s=0.6,
                   baseline_s=0.3, target=None, notes="beside the warm figure")]
'''
SECTIONS = '''
from bench.common import Result, Section

def run(out_dir):
    (out_dir / "load.png").write_bytes(b"png")
    return [Result(issue=0, name="nodes per second", baseline="one ticket alone", measured_s=30.0,
                   baseline_s=20.0, target=1.0, higher_is_better=True),
            Section("Load: 50 tickets", "| measurement | value |\\n|---|---|\\n| tickets succeeded | 49 of 50 |",
                    images=("load.png",), problems=("ticket t-1: events missing seq [7]",))]
'''
FAIL = '''
def run(out_dir):
    raise RuntimeError("docker engine went away")
'''


@pytest.fixture
def dummy_modules(tmp_path, monkeypatch):
    pkg = tmp_path / "dummybench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bench_ok.py").write_text(textwrap.dedent(OK))
    (pkg / "bench_broken.py").write_text(textwrap.dedent(FAIL))
    (pkg / "bench_sections.py").write_text(textwrap.dedent(SECTIONS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield ["dummybench.bench_broken", "dummybench.bench_ok"]
    for name in list(sys.modules):
        if name.startswith("dummybench"):
            del sys.modules[name]


@pytest.mark.timeout(120)
def test_report_table_chart_machine_and_failure(dummy_modules, tmp_path):
    out = tmp_path / "out"
    rc = bench_run.main(["--modules", *dummy_modules, "--out", str(out)])
    assert rc == 1   # a failed module makes the run fail, after the others ran
    report = (out / "REPORT.md").read_text()
    assert "| 3 | exec round trip | docker exec CLI | 20.00 ms | 50.00 ms | 0.4 | ≤ 1 | yes |" in report
    assert "| 4 | clone via mirror | fresh clone | 900.00 ms | 300.00 ms | 3 | ≤ 0.5 | **no** |" in report
    assert "| 5 | events per second | raw inserts | 4,000/s | 8,000/s | 0.5 | ≥ 0.4 | yes |" in report
    # a figure reported beside a target, with none of its own: neither met nor missed
    assert "| 5 | clone, cold cache | fresh clone | 600.00 ms | 300.00 ms | 2 | — | — |" in report
    assert "2 of the 3 with a target meet it" in report
    assert "dummybench.bench_broken" in report and "docker engine went away" in report
    for key in ("CPU", "cores", "memory", "kernel", "Docker", "Python"):
        assert f"**{key}**" in report
    assert (out / "ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_only_selects_one_module(dummy_modules, tmp_path):
    out = tmp_path / "out"
    assert bench_run.main(["--modules", *dummy_modules, "--only", "ok", "--out", str(out)]) == 0
    report = (out / "REPORT.md").read_text()
    assert "exec round trip" in report and "bench_broken" not in report
    with pytest.raises(SystemExit):
        bench_run.main(["--modules", *dummy_modules, "--only", "nosuch", "--out", str(out)])


def test_discover_finds_the_project_benchmarks():
    mods = bench_run.discover()
    assert all(m.startswith("bench.bench_") for m in mods)


@pytest.mark.timeout(120)
def test_section_is_printed_with_its_chart_and_its_problems_fail_the_module(dummy_modules, tmp_path):
    out = tmp_path / "out"
    rc = bench_run.main(["--modules", "dummybench.bench_sections", "--out", str(out)])
    assert rc == 1     # a failed check fails the run ...
    report = (out / "REPORT.md").read_text()
    # ... and the figures stay: the table row, the section, its chart, the problem.
    assert "| 0 | nodes per second | one ticket alone | 30/s | 20/s | 1.5 | ≥ 1 | yes |" in report
    assert "## Load: 50 tickets" in report and "| tickets succeeded | 49 of 50 |" in report
    assert "![Load: 50 tickets](load.png)" in report
    assert "**Checks failed:**" in report and "- ticket t-1: events missing seq [7]" in report
    assert "| `dummybench.bench_sections` | 1 |" in report and "| failed |" in report
