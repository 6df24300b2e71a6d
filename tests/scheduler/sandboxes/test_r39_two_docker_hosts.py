"""R39 and placement: the scheduler's side (`BrokerSet`, placement.py) with
two REAL sandbox broker processes, each on its own Docker engine (the main
one and a second `dockerd`, tests/support/second_docker.py, standing in for
a second host), reached over TCP with mutual TLS (`afe certs`).

- a scheduler certificate of another CA is refused by the real broker
  (positive control: ours is served);
- tickets are placed on the broker with room, each engine runs the sandbox
  placed on it, calls go to the right broker, also from a new `BrokerSet`
  reading the placement from the store (a restarted scheduler);
- a full set says so; a broker killed mid-way fails its tickets' calls with
  a message naming it while the other broker's tickets go on; when it comes
  back (new boot id) reconcile removes the sandbox of the ticket that ended
  while it was away: nothing is left on either engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.cli.certs import make_certs
from services.common.errors import PeerUnavailable, ResourceExhausted
from services.common.rpc.tls import TlsFiles, read_secret_file
from services.scheduler.sandboxes.brokers import SandboxClient
from services.scheduler.sandboxes.placement import BrokerSet, add_flags, from_flags
from services.scheduler.store.store import Store
from tests.scheduler.conftest import write_config
from tests.support.sandbox_broker import new_instance
from tests.support.second_docker import SecondEngine, second_engine

pytestmark = [pytest.mark.docker, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BrokerProcess:
    """`python -m services.sandbox.main --listen 127.0.0.1:PORT` with mutual TLS, on one Docker engine."""

    def __init__(self, root: Path, name: str, pki: Path, cfg: Path, instance: str, docker_host: str | None) -> None:
        self.root, self.name, self.pki, self.cfg = root / name, name, pki, cfg
        self.instance, self.docker_host = instance, docker_host
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        r, w = os.pipe()
        env = {"PATH": os.environ["PATH"], "HOME": str(self.root), "PYTHONPATH": str(REPO)}
        if self.docker_host:
            env["DOCKER_HOST"] = self.docker_host
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.sandbox.main", "--config", str(self.cfg),
             "--data", str(self.root / "data"), "--run", str(self.root / "run"), "--ops-port", "0",
             "--status-fd", str(w), "--instance", self.instance, "--listen", self.address,
             "--tls-cert", str(self.pki / f"{self.name}.pem"), "--tls-key", str(self.pki / f"{self.name}.key"),
             "--tls-ca", str(self.pki / "ca.pem"), "--link-secret-file", str(self.pki / f"{self.name}.secret")],
            pass_fds=(w,), env=env, cwd=REPO, stdout=open(self.root.with_suffix(".log"), "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            line = f.readline()
        assert line, f"sandbox broker {self.name} did not start; see {self.root.with_suffix('.log')}"
        assert json.loads(line)["listen"] == self.address

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def engine2() -> SecondEngine:
    got = second_engine()
    if isinstance(got, str):
        pytest.skip(f"no second Docker engine: {got}")
    return got


@pytest.fixture(scope="module")
def hosts(engine2, tmp_path_factory):
    """Two brokers (`one` on the main engine, `two` on the second), the PKI and a label for their objects."""
    root = tmp_path_factory.mktemp("hosts")
    pki = root / "pki"
    make_certs(pki, [("one", ["127.0.0.1"]), ("two", ["127.0.0.1"]), ("scheduler", [])])
    make_certs(root / "other-pki", [("scheduler", [])])
    cfg = write_config(root, "")
    instance = new_instance("mh")
    brokers = {"one": BrokerProcess(root, "one", pki, cfg, instance, None),
               "two": BrokerProcess(root, "two", pki, cfg, instance, engine2.host)}
    for b in brokers.values():
        (b.root / "data").mkdir(parents=True)
        b.start()
    try:
        yield {"root": root, "pki": pki, "brokers": brokers, "instance": instance}
    finally:
        for b in brokers.values():
            b.stop()
        for host in (None, engine2.host):   # nothing of ours may stay (the test asserts it; this is cleanup)
            _remove_labelled(host, instance)


def _docker(host: str | None, *args: str) -> str:
    cmd = ["docker", *(["-H", host] if host else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def _containers(host: str | None, instance: str) -> set[str]:
    out = _docker(host, "ps", "-a", "--filter", f"label=afe.instance={instance}",
                  "--format", '{{.Label "afe.ticket"}}')
    return {line for line in out.split() if line}


def _remove_labelled(host: str | None, instance: str) -> None:
    ids = _docker(host, "ps", "-aq", "--filter", f"label=afe.instance={instance}").split()
    if ids:
        _docker(host, "rm", "-f", *ids)
    nets = _docker(host, "network", "ls", "-q", "--filter", f"label=afe.instance={instance}").split()
    if nets:
        _docker(host, "network", "rm", *nets)


def _client(hosts, name: str, pki: Path | None = None) -> SandboxClient:
    pki = pki or hosts["pki"]
    b = hosts["brokers"][name]
    tls = TlsFiles(pki / "scheduler.pem", pki / "scheduler.key", hosts["pki"] / "ca.pem")
    return SandboxClient(b.address, read_secret_file(hosts["pki"] / f"{name}.secret", "secret"), tls=tls, name=name)


def _set(hosts, store, capacity: int = 1) -> BrokerSet:
    """The set as the scheduler makes it from its flags (`--sandbox-broker`, `--tls-*`)."""
    pki, b = hosts["pki"], hosts["brokers"]
    p = argparse.ArgumentParser()
    add_flags(p)
    args = p.parse_args([*(f"--sandbox-broker={n}={b[n].address},capacity={capacity}" for n in ("one", "two")),
                         "--tls-cert", str(pki / "scheduler.pem"), "--tls-key", str(pki / "scheduler.key"),
                         "--tls-ca", str(pki / "ca.pem")])
    brokers = from_flags(args, store)
    assert brokers is not None
    return brokers


async def _echo(brokers: BrokerSet, ticket: str) -> str:
    out = b""
    async for ev in brokers.exec(ticket, ["sh", "-c", f"echo on-{ticket}"], timeout_ms=30000):
        if ev.WhichOneof("event") == "stdout":
            out += ev.stdout
    return out.decode().strip()


async def _identify_when_back(brokers: BrokerSet, name: str) -> str:
    """The set's identity once `name` answers again (the channel reconnects after its back-off)."""
    for _ in range(600):
        got = await brokers.identify()
        if f"{name}=away" not in got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"the sandbox broker {name} did not answer again after its restart")


async def test_r39_real_broker_refuses_a_scheduler_of_another_ca(hosts):
    theirs = _client(hosts, "two", pki=hosts["root"] / "other-pki")
    ours = _client(hosts, "two")
    try:
        with pytest.raises(PeerUnavailable, match="sandbox broker two"):
            await theirs.identify()
        assert await ours.identify()            # positive control: same broker, our CA's certificate
    finally:
        await theirs.close()
        await ours.close()


async def test_r39_tickets_placed_on_two_docker_hosts_and_a_broker_that_goes_away(hosts, engine2, tmp_path):
    inst, two = hosts["instance"], hosts["brokers"]["two"]
    store = Store.sqlite(tmp_path / "afe.db")
    brokers = _set(hosts, store)
    try:
        await brokers.create("t-a", spb.SandboxSpec())
        await brokers.create("t-b", spb.SandboxSpec())
        placed = {t: store.placements.sandbox_placement(t) for t in ("t-a", "t-b")}
        assert sorted(placed.values()) == ["one", "two"]          # one each: capacity 1 per broker
        on_two = next(t for t, b in placed.items() if b == "two")
        on_one = next(t for t, b in placed.items() if b == "one")
        assert _containers(None, inst) == {on_one}                # each engine runs its own ticket's sandbox
        assert _containers(engine2.host, inst) == {on_two}
        assert await _echo(brokers, on_two) == f"on-{on_two}"

        with pytest.raises(ResourceExhausted, match=r"one full \(1/1\), two full \(1/1\)"):
            await brokers.create("t-c", spb.SandboxSpec())
        assert store.placements.sandbox_placement("t-c") is None

        # A restarted scheduler: a new set finds the placement in the store.
        await brokers.close()
        brokers = _set(hosts, store)
        assert await _echo(brokers, on_two) == f"on-{on_two}"
        boot = await brokers.identify()

        # Host two goes away: its ticket's calls fail naming it; host one's go on.
        two.kill()
        with pytest.raises(PeerUnavailable, match=f"sandbox broker two at {two.address} went away"):
            await _echo(brokers, on_two)
        assert await _echo(brokers, on_one) == f"on-{on_one}"
        assert "two=away" in await brokers.identify()
        with pytest.raises(PeerUnavailable):
            await brokers.destroy(on_two)                          # its teardown waits for the broker
        r = await brokers.reconcile([on_one])                      # the other ticket ended meanwhile
        assert "two=away" in r.boot_id
        assert _containers(engine2.host, inst) == {on_two}         # positive control: still there

        # It comes back (a new boot id): reconcile removes what ended while it was away.
        two.start()
        now = await _identify_when_back(brokers, "two")
        assert now != boot and "two=away" not in now
        r = await brokers.reconcile([on_one])
        assert on_two in r.removed_tickets
        assert _containers(engine2.host, inst) == set()
        assert await brokers.destroy(on_two) == 0                  # the retried teardown finds nothing
        assert await brokers.destroy(on_one) > 0
        assert _containers(None, inst) == set()
        assert store.placements.sandbox_placement(on_one) is None
    finally:
        await brokers.close()
        store.close()
