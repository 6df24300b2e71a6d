"""`afe up --max-failed-logins N --max-bad-webhook-signatures N` reach the
gateway (and only it); without them the gateway keeps its defaults; a budget
below one is refused by `afe up` at once, naming the flag (R40)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.main import _extra

from .launcher_support import launch_argv, make_config

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
FLAGS = ("--max-failed-logins", "--max-bad-webhook-signatures")


def test_the_budgets_go_to_the_gateway_only(tmp_path):
    argv = launch_argv(tmp_path, max_failed_logins=25, max_bad_webhook_signatures=4)
    pairs = list(itertools.pairwise(argv["gateway"]))
    assert ("--max-failed-logins", "25") in pairs and ("--max-bad-webhook-signatures", "4") in pairs
    for service, a in argv.items():
        if service != "gateway":
            assert not set(FLAGS) & set(a), service


def test_without_the_flags_the_gateway_keeps_its_defaults(tmp_path):
    assert not set(FLAGS) & set(launch_argv(tmp_path)["gateway"])


def test_the_gateway_takes_the_flags_and_refuses_zero():
    import argparse

    p = argparse.ArgumentParser(exit_on_error=False)
    _extra(p)
    args = p.parse_args(["--max-failed-logins", "25", "--max-bad-webhook-signatures", "4"])
    assert (args.max_failed_logins, args.max_bad_webhook_signatures) == (25, 4)
    assert (p.parse_args([]).max_failed_logins, p.parse_args([]).max_bad_webhook_signatures) == (10, 10)
    with pytest.raises(argparse.ArgumentError, match="give 1 or more"):
        p.parse_args(["--max-bad-webhook-signatures", "0"])


@pytest.mark.parametrize("flag", FLAGS)
def test_up_refuses_a_budget_below_one(tmp_path, flag):
    r = subprocess.run([sys.executable, "-m", "services.cli.main", "up", "--data", str(tmp_path / "d"),
                        "--config", str(make_config(tmp_path)), "--no-images", flag, "0"],
                       check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert flag in r.stderr and "1 or more" in r.stderr and "Traceback" not in r.stderr
