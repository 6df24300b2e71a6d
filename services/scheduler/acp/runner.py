"""Run one `agent:` workflow node: an ACP agent inside the ticket's sandbox.

    output = await run_agent_node(ticket_id=..., node=..., agent=...,
                                  prompt=..., sandbox=stub, emit=emit)

The agent process starts through the sandbox broker's interactive
`Process` with the agent's declared env NAMES only (R9). The engine is the
ACP client: `initialize` (advertising exactly fs read/write and terminal),
`session/new` in /workspace (with the node's MCP servers at the ticket's
relay, R43, when the agent advertises `mcpCapabilities.http`), one
`session/prompt` with the rendered prompt.
The node's output is the agent's final message; stop reasons other than
`end_turn` fail the node.

Failures raise AfeError subclasses with a reason a person can act on:
  DeadlineExceeded   the node's timeout passed (session/cancel, then kill)
  Unavailable        the agent process exited / could not start
  FailedPrecondition the agent broke the protocol, answered with an error,
                     or refused the prompt
  ResourceExhausted  an oversized message, or max_tokens/max_turn_requests
  Cancelled          the agent stopped the turn as cancelled on its own
The engine's own cancellation (ticket cancel) arrives as CancelledError:
session/cancel is sent, the process is killed, and the error is re-raised.
Whatever happens, the agent process and its terminals are gone on return.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from acp import PROTOCOL_VERSION, RequestError, text_block
from acp.client.connection import ClientSideConnection
from acp.meta import CLIENT_METHODS
from acp.schema import (
    ClientCapabilities,
    FileSystemCapabilities,
    HttpHeader,
    HttpMcpServer,
    Implementation,
    PromptResponse,
)
from pydantic import ValidationError

from services._gen.afe.sandbox.v1 import sandbox_pb2
from services.common.config.model import Agent, Node
from services.common.errors import (
    AfeError,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)

from .client import SandboxClient
from .events import EventLog, clip
from .paths import WORKSPACE
from .terminals import Terminals
from .transport import ProcessTransport

log = logging.getLogger(__name__)

Emit = Callable[[str, dict[str, Any]], Awaitable[None]]

SERVED_METHODS = frozenset(CLIENT_METHODS[k] for k in (
    "session_request_permission", "session_update", "fs_write_text_file", "fs_read_text_file",
    "terminal_create", "terminal_output", "terminal_release", "terminal_wait_for_exit", "terminal_kill"))

CANCEL_GRACE_S = 2.0       # after session/cancel, how long the agent may take to end its turn
KILL_WAIT_S = 5.0          # after kill, how long to wait for the broker to report the exit
CLIENT_INFO = Implementation(name="afe", title="afe", version="0.1")
CAPABILITIES = ClientCapabilities(
    fs=FileSystemCapabilities(read_text_file=True, write_text_file=True), terminal=True)

STOP_FAILURES: dict[str, tuple[type[AfeError], str]] = {
    "refusal": (FailedPrecondition, "the agent refused the prompt (stop reason: refusal)"),
    "max_tokens": (ResourceExhausted, "the agent ran out of tokens before finishing (stop reason: max_tokens)"),
    "max_turn_requests": (ResourceExhausted,
                          "the agent reached its turn request limit (stop reason: max_turn_requests)"),
    "cancelled": (Cancelled, "the agent ended the turn as cancelled although nobody cancelled it"),
}


class _Run:
    """State of one agent node run (one process, one session, one prompt)."""

    def __init__(self, *, ticket_id: str, node: Node, agent: Agent, sandbox: Any, emit: Emit,
                 env: dict[str, str] | None = None, mcp_servers: Sequence[tuple[str, str, str]] = ()) -> None:
        self.node = node
        self.mcp_servers = tuple(mcp_servers)
        self.agent = agent
        self.events = EventLog(emit)
        self.terminals = Terminals(sandbox, ticket_id)
        self.client = SandboxClient(ticket_id=ticket_id, sandbox=sandbox, events=self.events,
                                    terminals=self.terminals, deny=tuple(node.deny))
        start = sandbox_pb2.ProcessStart(ticket_id=ticket_id, argv=list(agent.command), cwd="",
                                         env_names=list(agent.env),
                                         env=[f"{k}={v}" for k, v in sorted((env or {}).items())])
        self.transport = ProcessTransport(sandbox, start, on_protocol_error=self.protocol_error,
                                          known_methods=SERVED_METHODS, on_stderr=self.events.stderr.feed)
        self.conn: ClientSideConnection | None = None
        self.session_id: str | None = None
        self.prompt_task: asyncio.Task[PromptResponse] | None = None
        self.step = "start"

    async def protocol_error(self, reason: str) -> None:
        self.events.record("agent.protocol_error", {"reason": clip(reason, 300)})

    def _lost(self) -> AfeError:
        """Why the connection is gone: transport failure, or the process ended."""
        if self.transport.failure is not None:
            return self.transport.failure
        ex = self.transport.exit
        if ex is not None:
            how = "was killed" if ex.code < 0 else f"exited with code {ex.code}"
            last = self.events.stderr.last_line()
            why = (f"its last stderr line: {last} (the ticket's agent.stderr events hold more)" if last
                   else "it wrote nothing on stderr; check its command, image and env")
            return Unavailable(f"agent {self.agent.name!r} {how} during {self.step}; {why}")
        return Unavailable(f"the connection to agent {self.agent.name!r} was lost during {self.step}")

    async def call(self, step: str, awaitable: Awaitable[Any]) -> Any:
        """Await one ACP request, turning every failure into an AfeError."""
        self.step = step
        try:
            return await awaitable
        except AfeError:
            raise
        except RequestError as exc:
            if self.transport.failure is not None:
                raise self.transport.failure from None
            raise FailedPrecondition(
                f"agent {self.agent.name!r} answered {step} with error {exc.code}: {clip(str(exc), 300)}") from None
        except ValidationError:
            await self.protocol_error(f"reply to {step} does not follow the ACP schema")
            raise FailedPrecondition(
                f"agent {self.agent.name!r} sent a reply to {step} that does not follow the ACP schema") from None
        except (ConnectionError, EOFError):
            raise self._lost() from None

    async def run(self, prompt: str) -> str:
        self.events.start()
        self.step = "start"
        await self.transport.open()
        self.conn = ClientSideConnection(self.client, self.transport)  # type: ignore[arg-type]  # duck-typed Client
        init = await self.call("initialize", self.conn.initialize(
            protocol_version=PROTOCOL_VERSION, client_capabilities=CAPABILITIES, client_info=CLIENT_INFO))
        if init.protocol_version != PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"agent {self.agent.name!r} speaks ACP protocol version {init.protocol_version}; "
                f"afe speaks version {PROTOCOL_VERSION}")
        session = await self.call("session/new", self.conn.new_session(cwd=WORKSPACE,
                                                                       mcp_servers=self.mcp_for(init)))
        self.session_id = session.session_id
        self.client.session_id = session.session_id
        self.prompt_task = asyncio.ensure_future(
            self.conn.prompt(session_id=session.session_id, prompt=[text_block(prompt)]))
        # shield: a timeout must not drop the pending request before session/cancel.
        resp = await self.call("session/prompt", asyncio.shield(self.prompt_task))
        failure = STOP_FAILURES.get(resp.stop_reason)
        if failure is not None:
            cls, why = failure
            raise cls(f"agent {self.agent.name!r}: {why}")
        return self.events.final_message()

    def mcp_for(self, init: Any) -> list[Any]:
        """The node's MCP servers for `session/new`: each at the ticket's relay, with the relay's
        capability as its bearer token, never the server's credential (R43); none when the agent
        cannot take an HTTP MCP server (it did not advertise `mcpCapabilities.http`)."""
        if not self.mcp_servers:
            return []
        names = [name for name, _, _ in self.mcp_servers]
        caps = getattr(getattr(init, "agent_capabilities", None), "mcp_capabilities", None)
        if not getattr(caps, "http", False):
            self.events.record("agent.mcp_servers", {
                "servers": names, "given": False,
                "reason": "the agent does not advertise mcpCapabilities.http in its initialize answer, so it "
                          "cannot take an HTTP MCP server; it ran without its granted MCP tools"})
            return []
        self.events.record("agent.mcp_servers", {"servers": names, "given": True})
        return [HttpMcpServer(type="http", name=name, url=url,
                              headers=[HttpHeader(name="Authorization", value=f"Bearer {cap}")])
                for name, url, cap in self.mcp_servers]

    async def shutdown(self, *, cancel: bool) -> None:
        """session/cancel (if a turn is running and we are stopping it), kill, close."""
        try:
            if self.prompt_task is not None and not self.prompt_task.done():
                if cancel and self.conn is not None and self.session_id and not self.transport.exited:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self.conn.cancel(session_id=self.session_id), 1.0)
                    self.events.record("agent.cancel", {"sent": "session/cancel"})
                    await asyncio.wait({self.prompt_task}, timeout=CANCEL_GRACE_S)
                self.prompt_task.cancel()
            self.transport.kill()
            await self.terminals.close()
            if self.conn is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.conn.close(), KILL_WAIT_S + 1)
            else:
                await self.transport.close()
        finally:
            self.transport.abort()
            if self.prompt_task is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(self.prompt_task, 0.1)
            await self.events.close()


async def run_agent_node(*, ticket_id: str, node: Node, agent: Agent, prompt: str, sandbox: Any,
                         emit: Emit, env: dict[str, str] | None = None,
                         mcp_servers: Sequence[tuple[str, str, str]] = ()) -> str:
    """Run an ACP agent for one node; return its final message (see module doc).
    `env`: literal, non-secret NAME=value settings for the agent's process only
    (the model relay's base URL and capability, R32; a preset's fixed settings).
    `mcp_servers`: (name, URL, capability) of the MCP servers at the ticket's relay (R43)."""
    if agent.type != "acp":
        raise InvalidArgument(f"agent {agent.name!r} has type {agent.type!r}; only 'acp' agents can run")
    if not agent.command:
        raise InvalidArgument(f"agent {agent.name!r} has no command")
    run = _Run(ticket_id=ticket_id, node=node, agent=agent, sandbox=sandbox, emit=emit, env=env,
               mcp_servers=mcp_servers)
    stopping = False
    try:
        try:
            async with asyncio.timeout(node.timeout_s):
                return await run.run(prompt)
        except TimeoutError:
            stopping = True
            await run.protocol_error(f"no result within the node timeout of {node.timeout_s:g}s")
            raise DeadlineExceeded(
                f"agent {agent.name!r} did not finish within the node timeout of {node.timeout_s:g}s "
                f"(during {run.step}); it was cancelled and killed") from None
        except asyncio.CancelledError:
            stopping = True
            raise
    except AfeError as exc:
        log.info("agent node %s failed: %s", node.id, exc.code)
        raise
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:  # a bug here must fail the node, not the scheduler
        log.exception("agent node %s failed unexpectedly", node.id)
        raise FailedPrecondition(f"agent {agent.name!r} failed: {type(exc).__name__}") from None
    finally:
        await asyncio.shield(_shutdown(run, stopping))


async def _shutdown(run: _Run, stopping: bool) -> None:
    try:
        await run.shutdown(cancel=stopping)
    except Exception:
        log.exception("cleaning up an agent node failed")
