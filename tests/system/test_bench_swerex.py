"""bench/bench_swerex.py: when SWE-ReX cannot be installed or started, the
report says exactly why (the failing step and its error), and the module
fails rather than passing without the peer."""

from __future__ import annotations

import sys

import pytest

from bench import bench_swerex
from bench.bench_swerex import CannotRun, _run
from bench.common import Section


def test_a_failing_step_is_named_with_its_error():
    with pytest.raises(CannotRun) as err:
        _run([sys.executable, "-c", ("import sys; print('line 1', file=sys.stderr); sys.exit('No matching "
              "distribution found for swe-rex==1.4.0')")], "pip install swe-rex==1.4.0")
    assert str(err.value) == ("pip install swe-rex==1.4.0 failed (exit 1): line 1\n"
                              "No matching distribution found for swe-rex==1.4.0")
    with pytest.raises(CannotRun, match=r"^docker build: .*No such file"):
        _run(["/nonexistent/docker", "build"], "docker build")


@pytest.mark.docker
def test_report_says_why_swerex_could_not_run(tmp_path, monkeypatch):
    def no_pypi() -> None:
        raise CannotRun("pip install swe-rex==1.4.0 into build/swerex/venv failed (exit 1): "
                        "ERROR: Could not find a version that satisfies the requirement swe-rex==1.4.0")

    monkeypatch.setattr(bench_swerex, "ensure_venv", no_pypi)
    [section] = bench_swerex.run(tmp_path)
    assert isinstance(section, Section)
    assert "SWE-ReX could not run on this machine" in section.body
    assert "Could not find a version that satisfies the requirement swe-rex==1.4.0" in section.body
    assert section.problems == (("SWE-ReX could not run here: pip install swe-rex==1.4.0 into build/swerex/venv "
                                "failed (exit 1): ERROR: Could not find a version that satisfies the "
                                "requirement swe-rex==1.4.0"),)
