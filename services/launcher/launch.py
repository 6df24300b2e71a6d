"""`afe up`: pre-flight, then start and supervise the four processes.

Pre-flight happens BEFORE anything starts: every TCP port it will listen on
is free (ports.py: else the port, its holder and the flag that moves it),
manifests load and validate, every variable a manifest names is set (the
error names the variable and the manifest, never a value), the Docker images
exist (built when missing), the runtime dir is 0700 and socket paths fit.
Then one random secret per link is made (gateway->scheduler,
scheduler->sandbox, scheduler->credentials, plus the `automation` secret in
`Layout.automation_key`), and the children start in order: sandbox broker,
credential broker, scheduler, gateway.

The launcher writes `<run>/launcher.json` (0600) with each child's pid and
ops port, rewritten on every (re)start; it holds no secret. Once stopped, it
says what it keeps on purpose (kept.py: the sandboxes, proxies, networks and
workspace disks of tickets still running, for the next start to resume) and
how to remove them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.common.config.manifests import load_config, missing_env
from services.common.config.model import Config
from services.common.config.presets import preset_for_image
from services.common.errors import AfeError, ConfigError, FailedPrecondition
from services.common.layout import DEFAULT_PORTS, Layout
from services.common.rpc.links import LinkSecrets, new_secret
from services.common.schema.sandboxenv import warnings as env_warnings
from services.common.secrecy.childenv import docker_cli_env
from services.launcher.process_supervisor import ChildSpec, Supervisor

from .environment import child_env
from .instance import resolve as resolve_instance
from .kept import report as report_kept
from .ports import check_ports, planned

log = logging.getLogger(__name__)

MODULES = {
    "sandbox": "services.sandbox.main",
    "credentials": "services.credentials.main",
    "scheduler": "services.scheduler.main",
    "gateway": "gateway.main",
}
ORDER = ("sandbox", "credentials", "scheduler", "gateway")
MAX_SOCKET_PATH = 100       # sun_path is 108 bytes including the NUL


@dataclass
class Options:
    config_dir: Path
    layout: Layout
    ops_host: str = "127.0.0.1"
    ops_names: tuple[str, ...] = ()   # more Host names the ops endpoints answer to (R38)
    ops_ports: dict[str, int] = field(default_factory=lambda: {
        s: DEFAULT_PORTS[f"{s}_ops"] for s in ORDER})
    listen: str = f"127.0.0.1:{DEFAULT_PORTS['gateway']}"
    public_url: str | None = None
    # The gateway's budgets of failed credentials per address and minute (R40), when not its defaults.
    max_failed_logins: int | None = None
    max_bad_webhook_signatures: int | None = None
    max_running: int | None = None
    sandbox_pool_max: int | None = None   # the scheduler's --sandbox-pool-max (warm sandboxes in all)
    ready_timeout: float = 90.0
    check_images: bool = True
    log_level: str | None = None
    instance: str | None = None      # the sandbox broker's afe.instance label (Docker objects it owns)
    egress_network: str = "bridge"   # the Docker network the egress proxies join (--egress-network)
    gvisor_runtime: str = "runsc"    # the engine's runtime of sandbox.runtime: gvisor (--gvisor-runtime)
    egress_transport: str = "network"   # how a runc sandbox reaches its proxy (--egress-transport)
    broker_recovery: float | None = None   # the scheduler's --broker-recovery (tests turn it off)
    # Sandbox brokers on other hosts (docs/SCALE.md): the scheduler's --sandbox-broker values and its
    # mutual-TLS files (--tls-cert/--tls-key/--tls-ca), passed through as given.
    sandbox_brokers: tuple[str, ...] = ()
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    # Several machines on one PostgreSQL database (join.py): --join, and --database-url instead of the variable.
    join: bool = False
    database_url: str | None = None
    python: str = sys.executable
    modules: dict[str, str] = field(default_factory=lambda: dict(MODULES))


def preflight(opts: Options, environ: Mapping[str, str],
              progress: Callable[[str], None] = print) -> Config:
    """Everything that can fail before a process starts. Raises AfeError."""
    config = load_config(opts.config_dir)
    unset = missing_env(config, environ)
    if unset:
        lines = [f"  {name} (named by {where} in {config.directory})" for name, where in unset]
        raise ConfigError("these environment variables are named by the manifests but not set; export "
                          "them (the manifests hold only their NAMES) and run `afe up` again:\n"
                          + "\n".join(lines))
    ca = environ.get("AFE_CA_FILE")
    if ca and not os.path.isfile(ca):
        raise ConfigError(f"AFE_CA_FILE={ca} is not a file: point it at the PEM bundle of the CA that signed "
                          "your git server's or API's certificate, or unset it")
    for service in ("scheduler", "sandbox", "credentials"):
        sock = opts.layout.socket(service)
        if len(str(sock).encode()) > MAX_SOCKET_PATH:
            raise ConfigError(f"the runtime folder path is too long for Unix sockets ({sock}); pass a "
                              "shorter --run DIR")
    _check_database(opts, environ)
    if opts.check_images:
        _ensure_images(progress)
        _check_other_images(config)
    else:   # --no-images: no builds, but the sandbox broker still needs the engine (named if it is down)
        _check_engine(environ)
    return config


def _check_engine(environ: Mapping[str, str]) -> None:
    from services.common.host.images import check_engine

    check_engine(environ)


def _check_database(opts: Options, environ: Mapping[str, str]) -> None:
    """With AFE_DATABASE_URL set: the store is reachable and its schema is not
    newer than this afe's, or `afe up` stops here with what to change (the
    scheduler, which alone keeps the URL, checks again when it opens it). The check is the
    scheduler's, run as a child (storecheck.py); its errors come back redacted."""
    from services.common.config.database_url import ENV

    from .storecheck import check_store

    if environ.get(ENV):
        check_store(opts.layout, environ, opts.python)


def _shared_database(opts: Options, environ: dict[str, str]) -> str:
    """--database-url and --join (join.py): the store's URL into `environ`, with mutual TLS to a
    PostgreSQL database when the TLS files are given; with --join, the deployment found there
    (returns its description), else an AfeError saying what to change."""
    from . import join

    url = join.resolve_url(environ, opts.database_url, opts.join)
    if not join.is_postgresql(url):
        return ""
    files = join.tls_files(opts.tls_cert, opts.tls_key, opts.tls_ca, opts.join)
    if files is not None:
        environ[join.ENV] = join.with_tls(url, files)
    if opts.join or files is not None:     # the TLS link checked now, so its errors say what to change
        found = join.check_deployment(environ[join.ENV], files, need_deployment=opts.join)
        return found if opts.join else ""
    return ""


def _plain_database_link(environ: Mapping[str, str]) -> str:
    from . import join

    url = environ.get(join.ENV, "")
    return join.plain_link_warning(url) if join.is_postgresql(url) else ""


def _check_other_images(config: Config) -> None:
    """Images a manifest names besides the bundled ones must already exist locally."""
    from services.common.host.images import PROXY_IMAGE, SANDBOX_IMAGE

    wanted: dict[str, str] = {}
    for w in config.workspaces.values():
        wanted.setdefault(w.sandbox.image, f"{w.source} Workspace {w.name} sandbox.image")
    for a in config.agents.values():
        if a.image:
            wanted.setdefault(a.image, f"{a.source} Agent {a.name} " + (f"preset {a.preset}" if a.preset else "image"))
    missing = []
    for image, where in sorted(wanted.items()):
        if image in (SANDBOX_IMAGE, PROXY_IMAGE):
            continue
        probe = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image],
                               capture_output=True, check=False, env=docker_cli_env())
        if probe.returncode != 0:
            preset = preset_for_image(image)
            fix = f"; build it with `afe images build --agent {preset.name}`" if preset else ""
            missing.append(f"  {image} (named by {where}{fix})")
    if missing:
        raise ConfigError("these Docker images do not exist on this machine; build or pull them, or fix the "
                          "manifest:\n" + "\n".join(missing))


def _ensure_images(progress: Callable[[str], None]) -> None:
    try:
        from services.common.host.images import ensure_images
    except ImportError as exc:  # the sandbox package is part of afe; this is a broken install
        raise FailedPrecondition("cannot check the Docker images: the sandbox package is missing "
                                 "(reinstall afe)") from exc
    ensure_images(progress)


def make_links() -> tuple[dict[str, LinkSecrets], bytes]:
    """One random secret per link; returns each service's LinkSecrets and the automation secret."""
    gw, sb, cr, auto = new_secret(), new_secret(), new_secret(), new_secret()
    return {
        "sandbox": LinkSecrets(serve={"scheduler": sb}),
        "credentials": LinkSecrets(serve={"scheduler": cr}),
        "scheduler": LinkSecrets(serve={"gateway": gw, "automation": auto},
                                 call={"sandbox": sb, "credentials": cr}),
        "gateway": LinkSecrets(call={"scheduler": gw}),
    }, auto


def _write_private(path: Path, data: bytes) -> None:
    """Write a file readable only by us (0600), replacing any previous one."""
    tmp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def ensure_token_file(layout: Layout, environ: Mapping[str, str]) -> str:
    """Where the login token is, for the start banner (never the token itself)."""
    if environ.get("AFE_UI_TOKEN"):
        return "the AFE_UI_TOKEN environment variable"
    path = layout.token_file
    if not path.exists():
        _write_private(path, (secrets.token_urlsafe(32) + "\n").encode())
    os.chmod(path, 0o600)
    return f"the file {path}"


def build_specs(opts: Options, config: Config, environ: Mapping[str, str],
                links: dict[str, LinkSecrets]) -> list[ChildSpec]:
    specs = []
    for service in ORDER:
        argv = [opts.python, "-m", opts.modules[service],
                "--config", str(config.directory),
                "--data", str(opts.layout.data_dir), "--run", str(opts.layout.run_dir),
                "--ops-host", opts.ops_host, "--ops-port", str(opts.ops_ports[service])]
        for name in opts.ops_names:
            argv += ["--ops-name", name]
        if opts.log_level:
            argv += ["--log-level", opts.log_level]
        if service == "sandbox" and opts.instance:
            argv += ["--instance", opts.instance]
        if service == "sandbox" and opts.egress_network != "bridge":
            argv += ["--egress-network", opts.egress_network]
        if service == "sandbox" and opts.gvisor_runtime != "runsc":
            argv += ["--gvisor-runtime", opts.gvisor_runtime]
        if service == "sandbox" and opts.egress_transport != "network":
            argv += ["--egress-transport", opts.egress_transport]
        if service == "scheduler" and opts.max_running is not None:
            argv += ["--max-running", str(opts.max_running)]
        if service == "scheduler" and opts.sandbox_pool_max is not None:
            argv += ["--sandbox-pool-max", str(opts.sandbox_pool_max)]
        if service == "scheduler" and opts.broker_recovery is not None:
            argv += ["--broker-recovery", str(opts.broker_recovery)]
        if service == "scheduler":
            for value in opts.sandbox_brokers:
                argv += ["--sandbox-broker", value]
            for flag, path in (("--tls-cert", opts.tls_cert), ("--tls-key", opts.tls_key),
                               ("--tls-ca", opts.tls_ca)):
                if path is not None:
                    argv += [flag, str(path)]
        if service == "scheduler":
            # Ticket links on GitHub (services/scheduler/github/report.py): the UI's address as users open it.
            argv += ["--public-url", (opts.public_url or f"http://{opts.listen}").rstrip("/")]
        if service == "gateway":
            argv += ["--token-file", str(opts.layout.token_file), "--listen", opts.listen]
            if opts.public_url:
                argv += ["--public-url", opts.public_url]
            for flag, count in (("--max-failed-logins", opts.max_failed_logins),
                                ("--max-bad-webhook-signatures", opts.max_bad_webhook_signatures)):
                if count is not None:
                    argv += [flag, str(count)]
        specs.append(ChildSpec(service, argv, child_env(service, config, environ), links[service]))
    return specs


def write_state(layout: Layout, sup: Supervisor) -> None:
    state = {"pid": os.getpid(), "children": {
        c.name: {"pid": c.pid, "ready": c.ready is not None, "restarts": c.restarts,
                 "ops_port": (c.ready or {}).get("ops_port")} for c in sup.children}}
    _write_private(layout.run_dir / "launcher.json", json.dumps(state).encode())


class _Lock:
    """One launcher per runtime folder."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise FailedPrecondition(f"another `afe up` is already running with the runtime folder "
                                     f"{path.parent}; stop it first or pass a different --run") from None

    def release(self) -> None:
        os.close(self.fd)


def egress_lines(config: Config, network: str) -> list[str]:
    """The banner's (and `afe doctor`'s) egress summary: the proxies' network
    and each Workspace's operator-allowed private destinations."""
    lines = [f"  egress network: {network} (the egress proxies join it; --egress-network)"]
    private = [f"{w.name}: {', '.join(w.sandbox.egress_private)}" for w in
               sorted(config.workspaces.values(), key=lambda w: w.name) if w.sandbox.egress_private]
    lines.append("  private egress: " + ("; ".join(private) if private else
                                          "none (every private address is refused)"))
    return lines


def _banner(opts: Options, config: Config, sup: Supervisor, token_where: str, out: Callable[[str], None]) -> None:
    gw = sup.child("gateway").ready or {}
    url = gw.get("url") or opts.public_url or f"http://{gw.get('listen') or opts.listen}/"
    out(f"afe is up: open {url}")
    out(f"  login token: in {token_where}")
    for c in sup.children:
        port = (c.ready or {}).get("ops_port")
        out(f"  {c.name:<12} pid {c.pid:<8} ops http://{opts.ops_host}:{port}/readyz")
    out(f"  automation key: {opts.layout.automation_key}")
    out(f"  instance: {opts.instance or 'default'} (the afe.instance label of its sandboxes; --instance)")
    for line in egress_lines(config, opts.egress_network):
        out(line)
    for line in env_warnings(config):   # as `afe check` says it (R9, R43)
        out(f"  warning: {line}")
    out("Press Ctrl-C to stop.")


def run(opts: Options, environ: Mapping[str, str] | None = None,
        out: Callable[[str], None] = print) -> int:
    environ = dict(os.environ if environ is None else environ)
    stop_requested: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stop_requested.append(signum)

    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            lock_file = opts.layout.run_dir / "launcher.lock"
            if lock_file.exists():     # another `afe up` here holds the ports too: say that, not "port taken"
                _Lock(lock_file).release()
            check_ports(planned(opts.listen, opts.ops_host, opts.ops_ports))
            joined = _shared_database(opts, environ)
            config = preflight(opts, environ, progress=lambda m: out(f"images: {m}"))
            if joined:
                out(f"afe up: joining the deployment on {joined}")
            elif warning := _plain_database_link(environ):
                out(f"afe up: {warning}")
            opts.layout.ensure()
            opts.instance = resolve_instance(opts.layout, opts.instance)   # this data folder's own label
            lock = _Lock(opts.layout.run_dir / "launcher.lock")
        except AfeError as exc:
            out(f"afe up: {exc}")
            return 1
        try:
            return _supervise(opts, config, environ, out, stop_requested)
        finally:
            lock.release()
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)


def _supervise(opts: Options, config: Config, environ: dict[str, str], out: Callable[[str], None],
               stop_requested: list[int]) -> int:
    links, automation = make_links()
    _write_private(opts.layout.automation_key, automation.hex().encode() + b"\n")
    token_where = ensure_token_file(opts.layout, environ)
    sup = Supervisor(build_specs(opts, config, environ, links), ready_timeout=opts.ready_timeout)
    try:
        try:
            sup.start_all(should_stop=lambda: bool(stop_requested))
        except AfeError as exc:
            out(f"afe up: {exc}")
            return 1
        write_state(opts.layout, sup)
        _banner(opts, config, sup, token_where, out)
        seen = _signature(sup)
        while not stop_requested:
            sup.tick(0.5)
            if _signature(sup) != seen:
                seen = _signature(sup)
                write_state(opts.layout, sup)
        out(f"afe up: stopping ({signal.Signals(stop_requested[0]).name})")
        return 0
    finally:
        started = time.monotonic()
        sup.stop_all()
        log.info("all processes stopped in %.1f s", time.monotonic() - started)
        if sup.child("sandbox").proc is not None:     # what is kept on purpose, and how to remove it
            report_kept(opts.layout, opts.instance or "default", environ, out)
        for leftover in (opts.layout.run_dir / "launcher.json", opts.layout.automation_key):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()


def _signature(sup: Supervisor) -> tuple[tuple[int | None, bool, int], ...]:
    return tuple((c.pid, c.ready is not None, c.restarts) for c in sup.children)
