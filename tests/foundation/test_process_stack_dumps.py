"""`kill -USR1 <pid>` makes an afe process print every thread's stack on its
stderr (its log), without stopping it: what a hung process waits for."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WAITER = """
import sys, threading, time
from services.common.process import enable_stack_dumps
if sys.argv[1] == "on":
    enable_stack_dumps()
def parked_in_a_thread():
    time.sleep(60)
threading.Thread(target=parked_in_a_thread, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def _dump(mode: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, "-c", WAITER, mode], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    alive = proc.poll() is None
    proc.kill()
    out, err = proc.communicate(timeout=10)
    return subprocess.CompletedProcess(proc.args, 0 if alive else proc.returncode, out, err)


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on():
    r = _dump("on")
    assert r.returncode == 0, "the process stopped on SIGUSR1"
    assert "parked_in_a_thread" in r.stderr and "most recent call first" in r.stderr, r.stderr


def test_positive_control_without_it_sigusr1_ends_the_process_and_says_nothing():
    r = _dump("off")
    assert r.returncode == -signal.SIGUSR1 and "parked_in_a_thread" not in r.stderr
