"""The node graph of one ticket: order from `needs` (`graphlib`), fan-out in
an `asyncio.TaskGroup`.

The rules (unchanged from the first engine):
- a node starts once every node it needs succeeded; independent nodes run
  at the same time;
- a node whose needed node failed, was skipped or cancelled is skipped
  ("a node it needs did not succeed");
- the first node that fails (`NodeFailed`) cancels every running sibling
  (their state becomes `cancelled`), nothing new starts, and every node that
  never started is skipped ("node X failed");
- a node already `succeeded` (a resumed ticket) is not run again; its
  output stays; a node in another non-pending state is left as it is;
- a cycle or a `needs` naming no node is refused before anything runs
  (the config loader refuses both too).

Any other exception (a bug, the store failing) cancels the siblings the same
way and propagates; so does the cancellation of the whole run.
"""

from __future__ import annotations

import asyncio
import graphlib
from collections.abc import Awaitable, Callable, Sequence

from services.common.config.model import Node
from services.common.errors import FailedPrecondition

from ..store.base import N_CANCELLED, N_FAILED, N_PENDING, N_RUNNING, N_SKIPPED, N_SUCCEEDED

NOT_SUCCEEDED = (N_FAILED, N_SKIPPED, N_CANCELLED)


class NodeFailed(Exception):
    """A node failed for good (its retries spent): the graph stops."""

    def __init__(self, node_id: str, reason: str, *, rejected: bool = False) -> None:
        super().__init__(reason)
        self.node_id = node_id
        self.reason = reason
        self.rejected = rejected   # a person's rejection or a spent budget: never sent back (on_failure)


def sorter(nodes: Sequence[Node]) -> graphlib.TopologicalSorter[str]:
    """A prepared `TopologicalSorter` over `needs`; refuses cycles and unknown ids."""
    ids = {n.id for n in nodes}
    for n in nodes:
        unknown = [d for d in n.needs if d not in ids]
        if unknown:
            raise FailedPrecondition(f"node {n.id!r} needs {', '.join(map(repr, unknown))}, which is not a node "
                                     "of the workflow; fix its `needs`")
    ts: graphlib.TopologicalSorter[str] = graphlib.TopologicalSorter({n.id: n.needs for n in nodes})
    try:
        ts.prepare()
    except graphlib.CycleError as exc:
        cycle = " -> ".join(exc.args[1])
        raise FailedPrecondition(f"the workflow's nodes form a dependency cycle ({cycle}); remove one of "
                                 "these needs") from None
    return ts


def ancestors(nodes: Sequence[Node]) -> dict[str, set[str]]:
    """Every node a node needs, directly or not (whose outputs its templates may read)."""
    by_id = {n.id: n for n in nodes}
    order, out = sorter(nodes), dict[str, set[str]]()
    while order.is_active():
        for nid in order.get_ready():
            out[nid] = set(by_id[nid].needs).union(*(out[d] for d in by_id[nid].needs))
            order.done(nid)
    return out


def descendants(nodes: Sequence[Node], ids: set[str]) -> set[str]:
    """`ids` and every node that needs one of them, directly or not (what a
    re-run of `ids` must run again)."""
    out = set(ids)
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if n.id not in out and out.intersection(n.needs):
                out.add(n.id)
                changed = True
    return out


async def run_graph(nodes: Sequence[Node], states: dict[str, str], run: Callable[[Node], Awaitable[None]],
                    skip: Callable[[str, str], None]) -> NodeFailed | None:
    """Run the pending nodes of `nodes` by the rules above. `states` (node id
    -> state) is read and kept current; `run(node)` runs one node to its end
    (raising `NodeFailed`); `skip(node_id, reason)` records a skipped node.
    Returns the failure that stopped the graph, or None."""
    by_id = {n.id: n for n in nodes}
    order = sorter(nodes)
    done: asyncio.Queue[str] = asyncio.Queue()

    async def one(node: Node) -> None:
        try:
            await run(node)
        except asyncio.CancelledError:
            states[node.id] = N_CANCELLED
            raise
        except NodeFailed:
            states[node.id] = N_FAILED
            raise
        states[node.id] = N_SUCCEEDED
        done.put_nowait(node.id)

    try:
        async with asyncio.TaskGroup() as group:
            while order.is_active():
                for nid in order.get_ready():
                    node = by_id[nid]
                    if states[nid] == N_PENDING:
                        if any(states[d] in NOT_SUCCEEDED for d in node.needs):
                            skip(nid, "a node it needs did not succeed")
                            states[nid] = N_SKIPPED
                        else:
                            states[nid] = N_RUNNING
                            group.create_task(one(node), name=f"node-{nid}")
                            continue
                    done.put_nowait(nid)   # nothing to run: its dependents may go on
                order.done(await done.get())
        return None
    except BaseExceptionGroup as group_error:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError from None   # the run itself was cancelled meanwhile
        failed, other = group_error.split(NodeFailed)
        if other is not None:
            raise _first(other) from None
        assert failed is not None
        failure = _first(failed)
        assert isinstance(failure, NodeFailed)
    for nid in by_id:
        if states[nid] == N_PENDING:
            skip(nid, f"node {failure.node_id} failed")
            states[nid] = N_SKIPPED
    return failure


def _first(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
