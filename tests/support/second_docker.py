"""A second Docker engine on this machine, standing in for a second host
(docs/SCALE.md): its own socket, data root, exec root and containerd
namespace, a bridge of its own and no iptables rules (so it cannot disturb
the main engine's: `--bridge none` would make dockerd delete the host's
`docker0`, which every container of the main engine uses). Started once and kept between runs (the images loaded into its
data root are the cache); `AFE_TEST_DOCKERD2` names another folder.

    engine = second_engine()      # or pytest.skip(reason) when it cannot start
    env = {"DOCKER_HOST": engine.host}

The images the sandbox broker needs (afe/sandbox, afe/proxy) are copied
from the main engine (`docker save | docker load`) when missing or stale.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.host.images import SANDBOX_IMAGE

PROXY_IMAGE = "afe/proxy:latest"
START_S = 60
BRIDGE = "afed2br0"                 # the second engine's own bridge, made by this module
BRIDGE_ADDR = "10.254.254.1/24"     # on this host only: no route leaves it (--ip-masq=false)


def _own_bridge() -> str | None:
    """Create the second engine's bridge when missing; an error text otherwise."""
    env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True, check=False, env=env).returncode == 0:
        return None
    for cmd in (["ip", "link", "add", BRIDGE, "type", "bridge"], ["ip", "addr", "add", BRIDGE_ADDR, "dev", BRIDGE],
                ["ip", "link", "set", BRIDGE, "up"]):
        r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if r.returncode != 0:
            return f"could not make the second engine's bridge ({' '.join(cmd)}): {r.stderr.strip()}"
    return None


@dataclass(frozen=True)
class SecondEngine:
    root: Path

    @property
    def socket(self) -> Path:
        return self.root / "docker.sock"

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    def docker(self, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", "-H", self.host, *args], capture_output=True, text=True, check=check,
                              env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root)}, **kw)

    def answers(self) -> bool:
        return self.socket.exists() and self.docker("version", "--format", "{{.Server.Version}}",
                                                    check=False, timeout=20).returncode == 0


def _image_id(host: str | None, image: str) -> str:
    cmd = ["docker", *(["-H", host] if host else []), "image", "inspect", "--format", "{{.Id}}", image]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return r.stdout.strip() if r.returncode == 0 else ""


def second_engine() -> SecondEngine | str:
    """The running second engine, or why it cannot run here (a skip reason).
    One caller at a time starts it and loads its images (a lock file next to
    its folder): test workers and other test runs share the one engine."""
    root = Path(os.environ.get("AFE_TEST_DOCKERD2", "/tmp/afe-d2"))
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _start_or_reuse(root)


def _start_or_reuse(root: Path) -> SecondEngine | str:
    engine = SecondEngine(root)
    if not engine.answers():
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            return "no dockerd binary on this machine to start a second Docker engine"
        if os.geteuid() != 0:
            return "a second Docker engine needs root (dockerd) and these tests do not run as root"
        root.mkdir(parents=True, exist_ok=True)
        problem = _own_bridge()
        if problem:
            return problem
        log = open(root / "dockerd.log", "ab")  # noqa: SIM115 - handed to the daemon, which outlives this call
        subprocess.Popen(
            [dockerd, "--host", engine.host, "--data-root", str(root / "root"), "--exec-root", str(root / "exec"),
             "--pidfile", str(root / "pid"), "--bridge", BRIDGE, "--iptables=false", "--ip-masq=false",
             "--containerd-namespace", "afe-d2", "--containerd-plugins-namespace", "afe-d2-plugins"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            env={"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")})
        log.close()
        end = time.monotonic() + START_S
        while not engine.answers():
            if time.monotonic() > end:
                tail = (root / "dockerd.log").read_text(errors="replace")[-800:]
                return f"a second dockerd did not start within {START_S}s (see {root}/dockerd.log): {tail}"
            time.sleep(0.5)
    for image in (SANDBOX_IMAGE, PROXY_IMAGE):
        want = _image_id(None, image)
        if not want:
            return f"the main Docker engine has no {image}; run `afe images build`"
        if _image_id(engine.host, image) != want:
            save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
            load = subprocess.run(["docker", "-H", engine.host, "load"], stdin=save.stdout, capture_output=True,
                                  check=False)
            save.wait()
            if load.returncode != 0 or _image_id(engine.host, image) != want:
                return f"could not load {image} into the second engine: {load.stderr.decode(errors='replace')}"
    return engine
