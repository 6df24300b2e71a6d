"""`afe up` with the four real processes: environment split (DESIGN §1, R30),
runtime dir and socket modes, per-link caller check, ops binding (R23),
supervision and shutdown."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config.model import Config
from services.common.errors import ConfigError
from services.common.layout import Layout
from services.common.rpc.grpcutil import open_channel
from services.common.rpc.links import new_secret
from services.launcher.environment import BASE_NAMES
from services.launcher.launch import Options, build_specs, ensure_token_file, make_links
from services.launcher.process_supervisor import Supervisor
from tests.support.temp_roots import remove_temp_root, temp_root

from .launcher_support import (
    CANARIES,
    ROOT,
    SERVICES,
    WHERE,
    alive,
    base_env,
    environ_bytes,
    environ_of,
    make_config,
    start_afe,
    wait_gone,
)
from .procnet import listeners

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def afe():
    base = temp_root("afe-fnd-")
    env = base_env(**CANARIES)
    running = start_afe(base, env)
    try:
        running.wait_up()
        yield running
    finally:
        code = running.stop()
        remove_temp_root(base)
        assert code == 0, running.text()[-3000:]


def allowed(service: str) -> set[str]:
    names = set(BASE_NAMES) | {"OTEL_SERVICE_NAME"}
    names |= {n for n, where in WHERE.items() if where == service}
    if service == "sandbox" and "DOCKER_HOST" in os.environ:
        names.add("DOCKER_HOST")
    return names


def test_r30_environment_split_each_child_gets_exactly_its_names(afe):
    pids = afe.pids()
    assert set(pids) == set(SERVICES)
    # Positive control: the launcher itself holds every canary, so a leak would show.
    launcher_env = environ_bytes(afe.proc.pid)
    for value in CANARIES.values():
        assert value.encode() in launcher_env
    for service, pid in pids.items():
        names = set(environ_of(pid))
        assert names == allowed(service) & (set(base_env()) | set(CANARIES)), (service, names)
        raw = environ_bytes(pid)
        for name, value in CANARIES.items():
            if WHERE[name] != service:
                assert value.encode() not in raw, f"{name}'s value reached {service}"
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        for value in CANARIES.values():
            assert value.encode() not in cmdline
        automation = (afe.run_dir / "automation.key").read_text().strip().encode()
        assert automation not in cmdline and automation not in raw   # link secrets travel on fds only


def test_r30_brokers_and_gateway_scrub_their_secrets_after_start(afe):
    """Each process that receives a secret deletes it from its environment
    (os.environ and the /proc environ block) once read."""
    pids = afe.pids()
    for name, service in WHERE.items():
        if service is None:
            continue
        raw = environ_bytes(pids[service])
        assert f"{name}=".encode() in raw          # it was handed over ...
        assert CANARIES[name].encode() not in raw  # ... and is gone now


def test_r30_take_secret_env_removes_value_from_os_environ_and_proc(tmp_path):
    script = (
        "import os\n"
        "from services.common.secrecy.env_secrets import take_secret_env\n"
        "from services.common.secrecy.redact import Redactor\n"
        "def proc(): return open('/proc/self/environ','rb').read()\n"
        "before = (os.environ.get('FND_X') is not None, b'canaryXYZ12345' in proc())\n"
        "r = Redactor(); got = take_secret_env(['FND_X'], r)\n"
        "after = ('FND_X' in os.environ, b'canaryXYZ12345' in proc())\n"
        "print(before, after, got['FND_X'].reveal() == 'canaryXYZ12345', repr(got['FND_X']),"
        " r.redact('x canaryXYZ12345 y'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "FND_X": "canaryXYZ12345"}, check=True).stdout
    # Positive control: before, the value is in both places; after, in neither.
    assert out.startswith("(True, True) (False, False) True SecretValue(FND_X=[secure]) x [redacted] y"), out


def test_runtime_dir_0700_sockets_and_keys_0600(afe):
    assert stat.S_IMODE(afe.run_dir.stat().st_mode) == 0o700
    for service in ("scheduler", "sandbox", "credentials"):
        sock = afe.run_dir / f"{service}.sock"
        st = sock.stat()
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600, service
    assert stat.S_IMODE((afe.run_dir / "automation.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((afe.run_dir / "launcher.json").stat().st_mode) == 0o600


def test_banner_names_url_token_source_and_ops_ports_never_the_token(afe):
    text = afe.text()
    assert "afe is up: open http://127.0.0.1:" in text
    assert "login token: in the AFE_UI_TOKEN environment variable" in text
    for value in CANARIES.values():
        assert value not in text
    for info in afe.state()["children"].values():
        assert f"ops http://127.0.0.1:{info['ops_port']}/readyz" in text
    # the agent's env: name is allowed, with the warning `afe check` gives (R9, R43); its value never shown
    assert "warning: agent coder: env: FND_AGENT_KEY enters the sandbox with its value" in text


def test_r23_children_ops_ports_listen_on_loopback_only(afe):
    for service, info in afe.state()["children"].items():
        assert listeners(info["ops_port"]) == {"127.0.0.1"}, service


async def _health(sock: Path, secret: bytes | None) -> grpc.StatusCode | int:
    async with open_channel(str(sock), secret) as ch:
        try:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return resp.status


async def test_scheduler_socket_serves_automation_key_and_refuses_others(afe):
    automation = bytes.fromhex((afe.run_dir / "automation.key").read_text().strip())
    sock = afe.run_dir / "scheduler.sock"
    assert await _health(sock, automation) == health_pb2.HealthCheckResponse.SERVING
    assert await _health(sock, None) == grpc.StatusCode.PERMISSION_DENIED
    assert await _health(sock, new_secret()) == grpc.StatusCode.PERMISSION_DENIED


async def test_brokers_refuse_a_secret_valid_on_another_link(afe):
    """The automation secret opens the scheduler, not a broker."""
    automation = bytes.fromhex((afe.run_dir / "automation.key").read_text().strip())
    for service in ("sandbox", "credentials"):
        sock = afe.run_dir / f"{service}.sock"
        assert await _health(sock, automation) == grpc.StatusCode.PERMISSION_DENIED, service
        assert await _health(sock, None) == grpc.StatusCode.PERMISSION_DENIED, service


@pytest.fixture(scope="module")
def brokers():
    """The two real brokers started by the launcher's own Supervisor, so the
    test knows the scheduler's link secrets."""
    base = temp_root("afe-fnb-")
    cfg = make_config(base)
    from services.common.config.manifests import load_config

    config = load_config(cfg)
    layout = Layout(base / "data", base / "run")
    layout.ensure()
    links, _ = make_links()
    opts = Options(config_dir=cfg, layout=layout, ops_ports={s: 0 for s in SERVICES},
                   instance=f"fnb-{os.getpid()}", check_images=False)
    specs = [s for s in build_specs(opts, config, base_env(**CANARIES), links)
             if s.service in ("sandbox", "credentials")]
    sup = Supervisor(specs, ready_timeout=120)
    try:
        sup.start_all()
        yield layout, links
    finally:
        sup.stop_all()
        remove_temp_root(base)


async def test_brokers_serve_only_the_scheduler_link_secret(brokers):
    layout, links = brokers
    scheduler = links["scheduler"].call
    gateway = links["gateway"].call["scheduler"]     # what a compromised gateway holds
    for service in ("sandbox", "credentials"):
        sock = layout.socket(service)
        assert await _health(sock, gateway) == grpc.StatusCode.PERMISSION_DENIED, service
        assert await _health(sock, None) == grpc.StatusCode.PERMISSION_DENIED, service
        # Positive control: the same call with the scheduler's secret is served.
        assert await _health(sock, scheduler[service]) == health_pb2.HealthCheckResponse.SERVING, service


def test_killed_child_is_restarted_with_backoff(afe):
    before = afe.pids()
    victim = before["credentials"]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = afe.state()
        info = st["children"]["credentials"] if st else None
        if info and info["pid"] != victim and info["ready"] and info["restarts"] >= 1:
            break
        time.sleep(0.2)
    else:
        pytest.fail("credentials was not restarted:\n" + afe.text()[-3000:])
    assert not alive(victim)
    assert alive(info["pid"])
    assert f"credentials (pid {victim}) exited" in afe.text()
    after = afe.pids()
    assert {k: v for k, v in after.items() if k != "credentials"} == \
        {k: v for k, v in before.items() if k != "credentials"}


def test_second_launcher_on_same_runtime_dir_is_refused(afe):
    out = subprocess.run([sys.executable, "-m", "services.cli.main", "up", "--config", str(afe.base / "cfg"),
                          "--data", str(afe.data), "--run", str(afe.run_dir), "--no-images"],
                         cwd=ROOT, env=base_env(**CANARIES), capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1
    assert "another `afe up` is already running" in out.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_stopping_the_launcher_leaves_no_process_behind(sig):
    """SIGTERM: everything stops within 10 s. SIGKILL: PR_SET_PDEATHSIG takes the children down.
    This launch also uses --ops-host 0.0.0.0 (R23 positive control)."""
    base = temp_root("afe-fns-")
    running = start_afe(base, base_env(**CANARIES), "--ops-host", "0.0.0.0")
    try:
        st = running.wait_up()
        pids = [c["pid"] for c in st["children"].values()]
        if sig == signal.SIGTERM:
            for info in st["children"].values():
                assert listeners(info["ops_port"]) == {"0.0.0.0"}
        assert all(alive(p) for p in pids)
        os.kill(running.proc.pid, sig)
        left = wait_gone(pids, 10.0)
        assert left == [], f"still running after 10 s: {left}\n{running.text()[-3000:]}"
        if sig == signal.SIGTERM:
            assert running.proc.wait(5) == 0
    finally:
        running.stop()
        remove_temp_root(base)


def test_unset_variable_fails_before_anything_starts(tmp_path):
    base = temp_root("afe-fnu-")
    try:
        env = base_env(**{k: v for k, v in CANARIES.items() if k != "FND_MODEL_KEY"})
        running = start_afe(base, env)
        code = running.proc.wait(60)
        time.sleep(0.1)
        text = running.text()
        assert code == 1
        assert "FND_MODEL_KEY (named by test.yaml#2 Model remote apiKeyEnv" in text
        for value in CANARIES.values():
            assert value not in text
        assert not (base / "run").exists()       # nothing started, not even the runtime dir
    finally:
        remove_temp_root(base)


def test_token_file_created_0600_when_no_env_token(tmp_path):
    layout = Layout(tmp_path / "data", tmp_path / "run")
    layout.ensure()
    where = ensure_token_file(layout, {})
    assert where == f"the file {layout.token_file}"
    assert stat.S_IMODE(layout.token_file.stat().st_mode) == 0o600
    token = layout.token_file.read_text()
    assert len(token.strip()) >= 32 and token.strip() not in where
    assert ensure_token_file(layout, {}) == where and layout.token_file.read_text() == token  # kept
    assert ensure_token_file(layout, {"AFE_UI_TOKEN": "x" * 32}) == "the AFE_UI_TOKEN environment variable"


def test_child_environments_follow_the_design_table(tmp_path):
    from services.launcher.environment import child_env

    cfg = make_config(tmp_path)
    from services.common.config.manifests import load_config

    config: Config = load_config(cfg)
    env = base_env(**CANARIES, DOCKER_HOST="unix:///x.sock", AFE_DATABASE_URL="sqlite:///x",
                   OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4317")
    common = {"PATH", "HOME", "LANG", "TZ", "OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_ENDPOINT"} & set(env)
    assert set(child_env("credentials", config, env)) == common | {"FND_GIT_TOKEN", "FND_MODEL_KEY"}
    assert set(child_env("sandbox", config, env)) == common | {"FND_AGENT_KEY", "DOCKER_HOST"}
    assert set(child_env("gateway", config, env)) == common | {"AFE_UI_TOKEN"}
    assert set(child_env("scheduler", config, env)) == common | {"AFE_DATABASE_URL"}


def test_preflight_refuses_a_missing_custom_image_before_starting(tmp_path):
    from services.launcher.launch import preflight

    cfg = make_config(tmp_path)
    text = (cfg / "test.yaml").read_text().replace(
        "forge: {type: local}\n", "forge: {type: local}\nsandbox: {image: 'afe/fnd-missing-image:none'}\n")
    (cfg / "test.yaml").write_text(text)
    layout = Layout(tmp_path / "data", tmp_path / "run")
    opts = Options(config_dir=cfg, layout=layout)
    with pytest.raises(ConfigError) as info:
        preflight(opts, base_env(**CANARIES), progress=lambda m: None)
    assert "afe/fnd-missing-image:none (named by test.yaml#1 Workspace calc sandbox.image)" in str(info.value)
    assert not layout.run_dir.exists()
    # Positive control: with the bundled image the same pre-flight passes.
    (cfg / "test.yaml").write_text(text.replace("afe/fnd-missing-image:none", "afe/sandbox:latest"))
    assert preflight(opts, base_env(**CANARIES), progress=lambda m: None).workspaces["calc"]


def test_preflight_refuses_a_runtime_dir_too_long_for_sockets(tmp_path):
    from services.launcher.launch import preflight

    cfg = make_config(tmp_path)
    layout = Layout(tmp_path / "data", tmp_path / ("r" * 120))
    with pytest.raises(ConfigError, match="too long for Unix sockets"):
        preflight(Options(config_dir=cfg, layout=layout, check_images=False), base_env(**CANARIES))


def test_ops_port_option_forms():
    from services.cli.up import parse_ops_ports

    assert parse_ops_ports([]) == {"sandbox": 9462, "credentials": 9463, "scheduler": 9461, "gateway": 9464}
    assert parse_ops_ports(["0"]) == dict.fromkeys(("sandbox", "credentials", "scheduler", "gateway"), 0)
    assert parse_ops_ports(["0", "gateway=9999"])["gateway"] == 9999
    for bad in ("x", "nope=1", "70000"):
        with pytest.raises(SystemExit):
            parse_ops_ports([bad])
