"""`afe doctor`'s sandbox broker: a real one, started as `afe up` starts it
(the launcher's process supervisor, a fresh link secret handed over through a
pipe, the environment `afe up` gives it) on the doctor's throwaway data and
runtime folders, and driven only over its gRPC contract (afe.sandbox.v1), as
the scheduler drives it. So the doctor proves what a ticket would get from
the broker process itself, and loads none of the broker's code.

The probe variable `AFE_DOCTOR_PROBE` reaches the broker as a ticket's agent
variables do: declared by an Agent manifest in the broker's config folder
(written here), its value in the broker's environment (R9)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Sequence

import grpc

from services._gen.afe.sandbox.v1 import sandbox_pb2 as pb
from services._gen.afe.sandbox.v1 import sandbox_pb2_grpc as pb_grpc
from services.common.config.manifests import load_config
from services.common.layout import Layout
from services.common.rpc.channels import open_channel, rpc_errors
from services.common.rpc.links import LinkSecrets, new_secret
from services.launcher.environment import child_env
from services.launcher.launch import MODULES
from services.launcher.process_supervisor import ChildSpec, Supervisor

PROBE_ENV = "AFE_DOCTOR_PROBE"
PROBE_AGENT = f"""\
kind: Agent
name: doctor-probe
type: acp
command: ["true"]
env: [{PROBE_ENV}]
"""
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 20.0


def broker_argv() -> list[str]:
    """The sandbox broker's command, as `afe up` runs it (services/launcher/launch.py)."""
    return [sys.executable, "-m", MODULES["sandbox"]]


class ProbeBroker:
    """One sandbox broker process for the doctor's probes (start, the calls, stop)."""

    def __init__(self, layout: Layout, instance: str, *, egress_network: str, allow_private: Sequence[str],
                 gvisor_runtime: str, probe_value: str, command: Sequence[str] | None = None) -> None:
        self.layout = layout
        self.instance = instance
        self.egress_network = egress_network
        self.allow_private = list(allow_private)
        self.gvisor_runtime = gvisor_runtime
        self.probe_value = probe_value
        self.command = list(command) if command is not None else broker_argv()
        self.secret = new_secret()
        self.supervisor: Supervisor | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.SandboxBrokerStub | None = None

    def start(self) -> None:
        """Start the broker and wait for its ready line (blocking: the doctor does nothing else meanwhile,
        and the supervisor's parent-death signal is tied to the thread that starts the child)."""
        config_dir = self.layout.data_dir.parent / "config"
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "afe.yaml").write_text(PROBE_AGENT)
        config = load_config(config_dir)
        env = child_env("sandbox", config, {**os.environ, PROBE_ENV: self.probe_value})
        argv = [*self.command, "--config", str(config_dir),
                "--data", str(self.layout.data_dir), "--run", str(self.layout.run_dir),
                "--ops-host", "127.0.0.1", "--ops-port", "0", "--log-level", "WARNING",
                "--instance", self.instance, "--egress-network", self.egress_network,
                "--gvisor-runtime", self.gvisor_runtime]
        for cidr in self.allow_private:
            argv += ["--allow-private", cidr]
        links = LinkSecrets(serve={"scheduler": self.secret})
        self.supervisor = Supervisor([ChildSpec("sandbox", argv, env, links)], ready_timeout=READY_TIMEOUT_S)
        self.supervisor.start_all()

    @property
    def stub(self) -> pb_grpc.SandboxBrokerStub:
        if self._stub is None:
            assert self.supervisor is not None, "start() first"
            ready = self.supervisor.child("sandbox").ready or {}
            self._channel = open_channel(str(ready["socket"]), self.secret)
            self._stub = pb_grpc.SandboxBrokerStub(self._channel)
        return self._stub

    async def stop(self) -> None:
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()
            self._channel = None
            self._stub = None
        if self.supervisor is not None:
            self.supervisor.stop_all(STOP_GRACE_S)
            self.supervisor = None

    async def identify(self) -> pb.IdentifyResponse:
        async with rpc_errors("sandbox broker", "Identify"):
            reply: pb.IdentifyResponse = await self.stub.Identify(pb.IdentifyRequest())
            return reply

    async def create(self, ticket_id: str, *, pids: int = 0, memory_bytes: int = 0, disk_bytes: int = 0,
                     env_names: Sequence[str] = (), runtime: str = "", egress: Sequence[str] = ()) -> pb.Sandbox:
        spec = pb.SandboxSpec(limits=pb.Limits(pids=pids, memory_bytes=memory_bytes, disk_bytes=disk_bytes),
                              env_names=list(env_names), runtime=runtime, egress=list(egress))
        async with rpc_errors("sandbox broker", "CreateSandbox"):
            reply: pb.Sandbox = await self.stub.CreateSandbox(pb.CreateSandboxRequest(ticket_id=ticket_id,
                                                                                      spec=spec))
            return reply

    async def destroy(self, ticket_id: str) -> int:
        async with rpc_errors("sandbox broker", "DestroySandbox"):
            reply: pb.DestroySandboxResponse = await self.stub.DestroySandbox(
                pb.DestroySandboxRequest(ticket_id=ticket_id))
            return reply.removed

    async def reconcile(self) -> pb.ReconcileResponse:
        """Everything of this instance removed (no ticket is live)."""
        async with rpc_errors("sandbox broker", "Reconcile"):
            reply: pb.ReconcileResponse = await self.stub.Reconcile(pb.ReconcileRequest(live_tickets=[]))
            return reply

    async def run_exec(self, ticket_id: str, argv: list[str], timeout_ms: int = 30000) -> tuple[int, str]:
        """(exit code, stdout and stderr as text, stripped) of one Exec; -1 without an ExecExit."""
        out: list[bytes] = []
        code = -1
        async with rpc_errors("sandbox broker", "Exec"):
            events: AsyncIterator[pb.ExecEvent] = self.stub.Exec(
                pb.ExecRequest(ticket_id=ticket_id, argv=argv, timeout_ms=timeout_ms))
            async for ev in events:
                kind = ev.WhichOneof("event")
                if kind == "exit":
                    code = ev.exit.code
                elif kind == "stdout":
                    out.append(ev.stdout)
                elif kind == "stderr":
                    out.append(ev.stderr)
        return code, b"".join(out).decode("utf-8", "replace").strip()

    async def run_process(self, ticket_id: str, argv: list[str], env_names: Sequence[str]) -> str:
        """An interactive Process given `env_names`, its stdin closed once started: what it printed."""
        started = asyncio.Event()
        done = asyncio.Event()

        async def inputs() -> AsyncIterator[pb.ProcessInput]:
            yield pb.ProcessInput(start=pb.ProcessStart(ticket_id=ticket_id, argv=argv, env_names=list(env_names)))
            await started.wait()
            yield pb.ProcessInput(close_stdin=True)
            await done.wait()

        out: list[bytes] = []
        try:
            async with rpc_errors("sandbox broker", "Process"):
                outputs: AsyncIterator[pb.ProcessOutput] = self.stub.Process(inputs())
                async for ev in outputs:
                    kind = ev.WhichOneof("output")
                    if kind == "started":
                        started.set()
                    elif kind == "stdout":
                        out.append(ev.stdout)
                    elif kind == "stderr":
                        out.append(ev.stderr)
                    elif kind == "exit":
                        break
        finally:
            started.set()
            done.set()
        return b"".join(out).decode().strip()
