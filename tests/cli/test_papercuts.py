"""CLI papercuts: a closed pipe ends `afe` quietly; `afe up --no-images`
with no Docker engine names the address it tried, without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.errors import Unavailable
from services.common.host.images import check_engine

ROOT = Path(__file__).resolve().parents[2]


def test_a_reader_that_goes_away_ends_afe_quietly():
    # `afe check --schema | head -1`: more output than the pipe holds, the reader leaves after a line.
    import fcntl

    read_fd, write_fd = os.pipe()
    fcntl.fcntl(read_fd, 1031, 4096)   # F_SETPIPE_SZ: 4 KiB, far less than the ~28 KiB schema
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.main", "check", "--schema"], cwd=ROOT,
                            stdout=write_fd, stderr=subprocess.PIPE)
    os.close(write_fd)
    assert proc.stderr is not None
    with os.fdopen(read_fd, "rb") as out:
        assert out.readline().strip() == b"{"
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_check_engine_names_the_docker_host_it_tried(tmp_path):
    nowhere = f"unix://{tmp_path}/no-docker.sock"
    with pytest.raises(Unavailable) as info:
        check_engine({**os.environ, "DOCKER_HOST": nowhere})
    assert f"the Docker engine at {nowhere} is not reachable" in info.value.message
    assert "set DOCKER_HOST" in info.value.message


def test_afe_up_no_images_without_docker_says_which_host(tmp_path):
    nowhere = f"unix://{tmp_path}/no-docker.sock"
    env = {**os.environ, "DOCKER_HOST": nowhere}
    r = subprocess.run([sys.executable, "-m", "services.cli.main", "up", "--no-images", "--data",
                        str(tmp_path / "data"), "--listen", "127.0.0.1:0", "--ops-port", "0"],
                       cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0
    assert f"the Docker engine at {nowhere} is not reachable" in r.stderr + r.stdout
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.docker
def test_check_engine_control_the_default_engine_answers():
    check_engine()   # the control: with the real engine, no error


def test_afe_verify_of_a_missing_file_says_so_without_asking_afe(tmp_path):
    """A target that is no file, ticket id, PR URL or number is refused before afe is asked (no token
    needed, none read); control: a ticket id goes on to afe (here: no token, which it then says)."""
    env = {k: v for k, v in os.environ.items() if k != "AFE_TOKEN"}
    missing = subprocess.run([sys.executable, "-m", "services.cli.main", "verify", str(tmp_path / "record.json"),
                              "--data", str(tmp_path)], check=False, cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 2 and "is not a file, a ticket id" in missing.stderr, missing.stderr
    ticket = subprocess.run([sys.executable, "-m", "services.cli.main", "verify", "t-0123456789ab",
                             "--data", str(tmp_path)], check=False, cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert ticket.returncode != 0 and "no token" in ticket.stderr, ticket.stderr
