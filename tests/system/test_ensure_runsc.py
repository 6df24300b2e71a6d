"""scripts/ensure_runsc.sh (called by .ci/run) registers gVisor's runsc with a
running dockerd only when it lacks it: the runtime appears after a reload,
dockerd keeps its pid, daemon.json keeps its other keys, and a second run
changes nothing.

The engine changed here is a dockerd of the test's own (its own config file,
socket, data root and bridge), so the machine's engine, which others use, is
never reloaded; against that engine the script only runs when it already has
runsc, where it must change nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "ensure_runsc.sh"
BRIDGE = "afersbr0"                   # this test's engine's bridge (no iptables, no route out)
BRIDGE_ADDR = "10.254.252.1/24"
START_S = 60
OTHER_KEYS = {"labels": ["afe-test=ensure-runsc"], "runtimes": {"afe-test-runc": {"path": "runc"}}}
PATH = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")


def _run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=120, check=False,
                          env={"PATH": PATH, **(env or {})})


def _runtimes(host: str) -> dict:
    out = _run("docker", "-H", host, "info", "--format", "{{json .Runtimes}}")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


class OwnEngine:
    """A dockerd started for this test and stopped (by its own pid) after it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = root / "daemon.json"
        self.pidfile = root / "pid"
        self.log = root / "dockerd.log"
        self.host = f"unix://{root}/docker.sock"
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {"DOCKER_HOST": self.host, "AFE_DOCKER_DAEMON_JSON": str(self.config),
                "AFE_DOCKERD_PIDFILE": str(self.pidfile), "AFE_DOCKERD_LOG": str(self.log)}

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                ["dockerd", "--config-file", str(self.config), "--host", self.host,
                 "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "exec"),
                 "--pidfile", str(self.pidfile), "--bridge", BRIDGE, "--iptables=false", "--ip-masq=false",
                 "--containerd-namespace", "afe-rs", "--containerd-plugins-namespace", "afe-rs-plugins"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env={"PATH": PATH})
        end = time.monotonic() + START_S
        while _run("docker", "-H", self.host, "version").returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > end:
                pytest.fail(f"the test's dockerd did not start: {self.log.read_text(errors='replace')[-800:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture
def own_engine() -> Iterator[OwnEngine]:
    if os.geteuid() != 0:
        pytest.skip("a Docker engine of the test's own needs root (dockerd) and these tests do not run as root")
    if shutil.which("dockerd") is None:
        pytest.fail("no dockerd on this machine: install docker.io")
    made_bridge = _run("ip", "link", "show", BRIDGE).returncode != 0
    if made_bridge:
        for cmd in (["ip", "link", "add", BRIDGE, "type", "bridge"], ["ip", "addr", "add", BRIDGE_ADDR, "dev", BRIDGE],
                    ["ip", "link", "set", BRIDGE, "up"]):
            r = _run(*cmd)
            assert r.returncode == 0, f"{' '.join(cmd)}: {r.stderr}"
    root = Path(tempfile.mkdtemp(prefix="afe-rs-", dir="/tmp"))   # short: the socket path has a length limit
    engine = OwnEngine(root)
    engine.config.write_text(json.dumps(OTHER_KEYS))
    try:
        engine.start()
        yield engine
    finally:
        engine.stop()
        _run("umount", "-R", str(root / "exec"))
        shutil.rmtree(root, ignore_errors=True)
        if made_bridge:
            _run("ip", "link", "del", BRIDGE)


def test_registers_runsc_with_a_running_engine_once_and_keeps_its_pid_and_other_keys(own_engine):
    if not Path("/usr/bin/runsc").exists():
        pytest.skip("gVisor's runsc is not installed (.ci/run installs it: apt-get install runsc)")
    # Positive control: the engine really lacks runsc, so the first run has work to do.
    before = _runtimes(own_engine.host)
    assert "runsc" not in before and "afe-test-runc" in before
    pid = own_engine.pidfile.read_text().strip()

    first = _run("bash", str(SCRIPT), env=own_engine.env())
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"reloading dockerd (pid {pid}, SIGHUP)" in first.stdout
    after = _runtimes(own_engine.host)
    assert after["runsc"] == {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none", "--host-uds=open"]}
    assert "afe-test-runc" in after
    config = json.loads(own_engine.config.read_text())
    assert config["labels"] == OTHER_KEYS["labels"]
    assert config["runtimes"]["afe-test-runc"] == OTHER_KEYS["runtimes"]["afe-test-runc"]
    assert own_engine.pidfile.read_text().strip() == pid and own_engine.proc.poll() is None

    text, mtime = own_engine.config.read_bytes(), own_engine.config.stat().st_mtime_ns
    second = _run("bash", str(SCRIPT), env=own_engine.env())
    assert second.returncode == 0, second.stdout + second.stderr
    assert "already has the runtime runsc; nothing to do" in second.stdout
    assert own_engine.config.read_bytes() == text and own_engine.config.stat().st_mtime_ns == mtime
    assert own_engine.pidfile.read_text().strip() == pid and own_engine.proc.poll() is None


def test_a_runtime_that_never_appears_fails_with_the_dockerd_log(own_engine):
    """The reload reaches something that is not this engine (a pidfile naming
    a process of the test's own): the engine never lists runsc, and the
    script fails after its bounded wait, showing the log it was given."""
    if not Path("/usr/bin/runsc").exists():
        pytest.skip("gVisor's runsc is not installed (.ci/run installs it: apt-get install runsc)")
    stand_in = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        pidfile = own_engine.root / "other.pid"
        pidfile.write_text(str(stand_in.pid))
        log = own_engine.root / "other.log"
        log.write_text("a line of the dockerd log\n")
        env = {**own_engine.env(), "AFE_DOCKERD_PIDFILE": str(pidfile), "AFE_DOCKERD_LOG": str(log),
               "AFE_RUNSC_WAIT_S": "2"}
        r = _run("bash", str(SCRIPT), env=env)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "did not list runsc within 2 s after the reload" in r.stdout and "a line of the dockerd log" in r.stdout
        assert "runsc" not in _runtimes(own_engine.host)
    finally:
        stand_in.kill()
        stand_in.wait(timeout=10)


def test_before_start_writes_the_entry_once_keeping_other_keys(tmp_path):
    if not Path("/usr/bin/runsc").exists():
        pytest.skip("gVisor's runsc is not installed (.ci/run installs it: apt-get install runsc)")
    config = tmp_path / "daemon.json"
    config.write_text(json.dumps({"log-level": "warn", "runtimes": {"other": {"path": "/bin/true"}}}))
    env = {"AFE_DOCKER_DAEMON_JSON": str(config)}
    first = _run("bash", str(SCRIPT), "--before-start", env=env)
    assert first.returncode == 0 and ": changed" in first.stdout, first.stdout + first.stderr
    written = json.loads(config.read_text())
    assert written["log-level"] == "warn" and written["runtimes"]["other"] == {"path": "/bin/true"}
    assert written["runtimes"]["runsc"]["runtimeArgs"] == ["--network=none", "--host-uds=open"]
    text = config.read_bytes()
    second = _run("bash", str(SCRIPT), "--before-start", env=env)
    assert second.returncode == 0 and ": unchanged" in second.stdout, second.stdout + second.stderr
    assert config.read_bytes() == text

    absent = tmp_path / "new" / "daemon.json"
    made = _run("bash", str(SCRIPT), "--before-start", env={"AFE_DOCKER_DAEMON_JSON": str(absent)})
    assert made.returncode == 0, made.stdout + made.stderr
    assert set(json.loads(absent.read_text())) == {"runtimes"}

    config.write_text("{not json")
    broken = _run("bash", str(SCRIPT), "--before-start", env=env)
    assert broken.returncode != 0 and "is not valid JSON" in broken.stderr and "fix it by hand" in broken.stderr
    assert config.read_text() == "{not json"


def test_the_machines_engine_with_runsc_is_left_alone():
    """Against this machine's engine (which others use) only when it already
    has runsc: twice, no change to daemon.json and no reload."""
    if "runsc" not in _runtimes("unix:///var/run/docker.sock"):
        pytest.skip("this machine's Docker engine has no runsc runtime; .ci/run registers it "
                    "(scripts/ensure_runsc.sh)")
    config = Path("/etc/docker/daemon.json")
    before = config.read_bytes() if config.exists() else None
    pid = Path("/var/run/docker.pid").read_text().strip()
    for _ in range(2):
        r = _run("bash", str(SCRIPT), env={"DOCKER_HOST": "unix:///var/run/docker.sock"})
        assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout + r.stderr
    assert (config.read_bytes() if config.exists() else None) == before
    assert Path("/var/run/docker.pid").read_text().strip() == pid
