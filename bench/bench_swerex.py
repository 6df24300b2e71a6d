"""A peer in the same run (the speed issue, item 6): SWE-agent's sandbox
runtime SWE-ReX (`swe-rex` on PyPI) with its Docker deployment, beside afe's
sandbox broker, on this machine.

SWE-ReX never enters afe's environment: it is installed into its own venv
(`build/swerex/venv`), and its server into a local image built FROM
afe/sandbox:latest (the same Debian and Python as afe's sandbox) from wheels
downloaded on the host (`pip download`), installed with `--no-index` in a
`docker build --network none`: the build needs no registry and no
certificate of the host's. SWE-ReX's `DockerDeployment` (its real client,
bench/swerex_driver.py in its venv) starts that image with `pull="never"`.

Measured, p50 (p95 in the notes), afe / SWE-ReX (target <= 1.0: afe is no
slower than the peer):

- start -> first command's output: afe's CreateSandbox + Exec `echo hi`
  (cold: no warm pool, hardened container with no network) vs SWE-ReX's
  `start()` + `create_session` + `run_in_session("echo hi")` (what SWE-agent
  does) — and vs `start()` + `execute(["echo", "hi"])`, its cheapest path;
- per-command latency of `true`: afe's supervised Exec over gRPC vs SWE-ReX's
  `run_in_session` (SWE-agent's path) and `execute`.

Starts alternate between afe and SWE-ReX so load falls on both alike. When
SWE-ReX cannot be installed or run here, the report says why (the error).
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Result, Section

ISSUE = 16             # the speed issue (item 6: a peer in the same run)
SWEREX_VERSION = "1.4.0"
# aiohttp: swe-rex's client imports it (swerex/runtime/remote.py) without declaring it.
CLIENT_EXTRAS = ("aiohttp",)
ROUNDS = 5             # cold starts of each, alternating
COMMANDS = 50          # per-command samples of each
ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "swerex"
IMAGE = f"afe-bench/swerex:{SWEREX_VERSION}"
DRIVER = Path(__file__).resolve().parent / "swerex_driver.py"

DOCKERFILE = """\
FROM {base}
USER root
COPY wheels /tmp/wheels
RUN python3 /tmp/wheels/{pip}/pip install --no-index --find-links /tmp/wheels --break-system-packages \\
        --no-cache-dir --no-compile swe-rex=={version} \\
 && rm -rf /tmp/wheels && swerex-remote --help >/dev/null
USER {user}
LABEL afe.bench=swerex
"""


class CannotRun(Exception):
    """SWE-ReX could not be installed or started here; the message says why."""


def _p(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def _ms(samples: list[float]) -> str:
    return f"p50 {_p(samples, .5) * 1000:.1f} ms / p95 {_p(samples, .95) * 1000:.1f} ms"


def _run(argv: list[str], what: str, timeout: float = 600) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CannotRun(f"{what}: {exc}") from None
    if out.returncode != 0:
        tail = "\n".join((out.stderr or out.stdout).strip().splitlines()[-6:])
        raise CannotRun(f"{what} failed (exit {out.returncode}): {tail}")
    return out.stdout


def ensure_venv() -> Path:
    """SWE-ReX's client in its own venv (not afe's runtime dependencies)."""
    py = BUILD / "venv" / "bin" / "python"
    if not py.exists():
        BUILD.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", str(BUILD / "venv")], "creating SWE-ReX's venv")
    check = subprocess.run([str(py), "-c", "import swerex, aiohttp; print(swerex.__version__)"],
                           capture_output=True, text=True, check=False)
    if check.stdout.strip() != SWEREX_VERSION:
        _run([str(py), "-m", "pip", "install", "--quiet", f"swe-rex=={SWEREX_VERSION}", *CLIENT_EXTRAS],
             f"pip install swe-rex=={SWEREX_VERSION} into {BUILD / 'venv'}")
    return py


def image_python(base: str) -> tuple[str, str]:
    """(major.minor, user) of the base image's python3, for the wheels to download."""
    ver = _run(["docker", "run", "--rm", "--network", "none", base, "python3", "-c",
                "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
               f"python3 in {base}").strip()
    user = _run(["docker", "image", "inspect", base, "--format", "{{.Config.User}}"], "docker image inspect")
    return ver, user.strip() or "root"


def build_image(py: Path, base: str) -> str:
    """A local image FROM `base` with SWE-ReX's server, from wheels downloaded on the host."""
    ver, user = image_python(base)
    wheels = BUILD / f"wheels-py{ver}"
    if not any(wheels.glob("swe_rex-*.whl")) or not any(wheels.glob("pip-*.whl")):
        shutil.rmtree(wheels, ignore_errors=True)
        _run([str(py), "-m", "pip", "download", "--quiet", "-d", str(wheels), "--only-binary=:all:",
              "--python-version", ver, "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
              "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
              f"swe-rex=={SWEREX_VERSION}", "pip"],
             f"pip download of swe-rex=={SWEREX_VERSION}'s wheels for Python {ver}")
    pip = max(wheels.glob("pip-*.whl")).name
    with tempfile.TemporaryDirectory(prefix="afe-swerex-") as tmp:
        ctx = Path(tmp)
        shutil.copytree(wheels, ctx / "wheels")
        (ctx / "Dockerfile").write_text(DOCKERFILE.format(base=base, pip=pip, version=SWEREX_VERSION, user=user))
        _run(["docker", "build", "--quiet", "--network", "none", "-t", IMAGE, str(ctx)],
             f"docker build of {IMAGE} FROM {base}")
    return IMAGE


def swerex_samples(py: Path, label: str, starts: int, commands: int) -> dict:
    out = _run([str(py), str(DRIVER), IMAGE, label, str(starts), str(commands)],
               "SWE-ReX's DockerDeployment", timeout=600)
    return json.loads(out.strip().splitlines()[-1])


def _leftovers(label: str) -> list[str]:
    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={label}"], capture_output=True,
                         text=True, check=False)
    return out.stdout.split()


def write_chart(rows: list[tuple[str, list[float], list[float]]], path: Path) -> Path:
    """Grouped bars: afe beside SWE-ReX, p50 with a p95 whisker, log scale (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    ys = range(len(rows))
    h = 0.38
    for off, idx, color, label in ((-h / 2, 1, "#2e7d32", "afe"), (h / 2, 2, "#1565c0", "SWE-ReX")):
        p50 = [_p(r[idx], .5) * 1000 for r in rows]
        p95 = [_p(r[idx], .95) * 1000 for r in rows]
        ax.barh([y + off for y in ys], p50, height=h, color=color, label=f"{label} p50")
        ax.errorbar(p95, [y + off for y in ys], fmt="|", color="black", markersize=10)
        for y, v, top in zip(ys, p50, p95, strict=True):
            ax.text(max(v, top) * 1.15, y + off, f"{v:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(list(ys), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(right=max(_p(r[i], .95) for r in rows for i in (1, 2)) * 1000 * 4)
    ax.set_xlabel("milliseconds (bar: p50; black tick: p95), log scale")
    ax.set_title(f"afe vs SWE-ReX {SWEREX_VERSION} (DockerDeployment), same run")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _afe_start(stub, pb, ticket: str) -> float:
    t0 = time.perf_counter()
    stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket))
    out = b""
    for ev in stub.Exec(pb.ExecRequest(ticket_id=ticket, argv=["echo", "hi"])):
        out += ev.stdout
        if out:
            break
    dt = time.perf_counter() - t0
    stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id=ticket))
    if out.strip() != b"hi":
        raise RuntimeError(f"afe's first output was {out!r}")
    return dt


def run(out_dir: Path) -> list[Result | Section]:
    import docker

    from bench.bench_sandbox import _Broker, _exec
    from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
    from services.common.host.images import SANDBOX_IMAGE, ensure_images
    from tests.support.temp_roots import remove_temp_root, temp_root

    out_dir = Path(out_dir)
    ensure_images(progress=lambda _m: None)
    title = f"Peer: SWE-ReX {SWEREX_VERSION} (SWE-agent's sandbox runtime) beside afe (bench_swerex)"
    try:
        py = ensure_venv()
        build_image(py, SANDBOX_IMAGE)
    except CannotRun as exc:
        why = str(exc)
        return [Section(title, f"SWE-ReX could not run on this machine, so there is no peer figure:\n\n"
                               f"```\n{why}\n```", problems=(f"SWE-ReX could not run here: {why.splitlines()[0]}",))]

    label = f"afe.bench.swerex={secrets.token_hex(4)}"
    client = docker.from_env()
    instance = "bench" + secrets.token_hex(4)
    root = temp_root("afe-bsx-")
    net = client.networks.create(f"afe-bench-{instance}", labels={"afe.instance": instance})
    net.reload()
    subnet = net.attrs["IPAM"]["Config"][0]["Subnet"]
    afe_start: list[float] = []
    afe_cmd: list[float] = []
    rex = {"start_session_s": [], "start_execute_s": [], "session_s": [], "execute_s": []}
    error = ""
    try:
        with _Broker(root, instance, egress_network=net.name, allow_private=subnet) as b:
            _afe_start(b.stub, pb, "bench-swerex-warm")        # warm-up, untimed
            for i in range(ROUNDS):
                afe_start.append(_afe_start(b.stub, pb, f"bench-swerex-{i}"))
                try:
                    got = swerex_samples(py, label, 1, COMMANDS if i == ROUNDS - 1 else 0)
                except CannotRun as exc:
                    error = str(exc)
                    break
                for k in rex:
                    rex[k] += got[k]
            b.stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id="bench-swerex-cmd"))
            for i in range(COMMANDS + 3):
                t0 = time.perf_counter()
                _exec(b.stub, "bench-swerex-cmd", ["true"])
                if i >= 3:
                    afe_cmd.append(time.perf_counter() - t0)
            b.stub.DestroySandbox(pb.DestroySandboxRequest(ticket_id="bench-swerex-cmd"))
    finally:
        left = _leftovers(label)
        if left:   # ours (the label is this run's): remove them, and say so
            subprocess.run(["docker", "rm", "-f", *left], capture_output=True, check=False)
        net.remove()
        client.close()
        remove_temp_root(root)

    problems = []
    if left:
        problems.append(f"SWE-ReX left {len(left)} container(s) after DockerDeployment.stop() (removed here)")
    if error:
        body = (f"SWE-ReX's image was built ({IMAGE}), but its DockerDeployment failed here, so there is no "
                f"peer figure:\n\n```\n{error}\n```")
        return [Section(title, body, problems=(f"SWE-ReX could not run here: {error.splitlines()[0]}",))]

    rows = [("start → first output (SWE-agent: start + session + echo)", afe_start, rex["start_session_s"]),
            ("start → first output (SWE-ReX execute, no session)", afe_start, rex["start_execute_s"]),
            ("per command `true` (SWE-ReX run_in_session)", afe_cmd, rex["session_s"]),
            ("per command `true` (SWE-ReX execute)", afe_cmd, rex["execute_s"])]
    chart = write_chart(rows, out_dir / "swerex.png")
    med = lambda s: _p(s, .5)
    results = [
        Result(ISSUE, "peer: start -> first command output, afe cold vs SWE-ReX (start + bash session)",
               f"SWE-ReX {SWEREX_VERSION} DockerDeployment: start, create_session, run_in_session",
               med(afe_start), med(rex["start_session_s"]), 1.0,
               notes=f"afe {_ms(afe_start)}; SWE-ReX {_ms(rex['start_session_s'])}; {ROUNDS} each, alternating"),
        Result(ISSUE, "peer: start -> first command output, afe cold vs SWE-ReX (start + execute)",
               f"SWE-ReX {SWEREX_VERSION} DockerDeployment: start, execute",
               med(afe_start), med(rex["start_execute_s"]), 1.0,
               notes=f"afe {_ms(afe_start)}; SWE-ReX {_ms(rex['start_execute_s'])}"),
        Result(ISSUE, "peer: per-command latency (`true`), afe supervised Exec vs SWE-ReX run_in_session",
               f"SWE-ReX {SWEREX_VERSION} run_in_session (bash session, SWE-agent's path)",
               med(afe_cmd), med(rex["session_s"]), 1.0,
               notes=f"afe {_ms(afe_cmd)}; SWE-ReX {_ms(rex['session_s'])}; {COMMANDS} each"),
        Result(ISSUE, "peer: per-command latency (`true`), afe supervised Exec vs SWE-ReX execute",
               f"SWE-ReX {SWEREX_VERSION} execute (subprocess per command)",
               med(afe_cmd), med(rex["execute_s"]), 1.0,
               notes=f"afe {_ms(afe_cmd)}; SWE-ReX {_ms(rex['execute_s'])}; {COMMANDS} each"),
    ]
    table = ["| measurement | afe | SWE-ReX | afe / SWE-ReX (p50) |", "|---|---:|---:|---:|"]
    table += [f"| {name} | {_ms(a)} | {_ms(r)} | {med(a) / med(r):.2f} |" for name, a, r in rows]
    body = "\n".join(table) + (
        f"\n\nSWE-ReX {SWEREX_VERSION} from PyPI in its own venv; its server in `{IMAGE}`, built FROM "
        f"`{SANDBOX_IMAGE}` (`docker build --network none`, wheels downloaded on the host, installed with "
        "`--no-index`); started by its `DockerDeployment(image=..., pull=\"never\", python_standalone_dir=None)`, "
        "which runs `docker run --rm -p PORT:8000 IMAGE swerex-remote --auth-token ...` and polls the server "
        "every 0.25 s until it answers. afe: the sandbox broker process (`services.sandbox.main`), a cold "
        "sandbox per start (no warm pool; `--network none`, read-only root, dropped capabilities) and commands "
        "through the in-sandbox supervisor over gRPC. Note: swe-rex 1.4.0's client imports aiohttp without "
        "declaring it; the venv installs it too.")
    return [*results, Section(title, body, images=(chart.name,), problems=tuple(problems))]


if __name__ == "__main__":
    for item in run(ROOT / "bench" / "out"):
        print(item)
