"""Time to a ticket's first output, as a user watching it sees it: from
CreateTicket to the first `node.output` event its live WatchTicket stream
delivers (a one-node `run: echo go` ticket, warm mirror and image, the real
brokers and the scheduler as its own process, the store SQLite or a
PostgreSQL server of its own). Prints one JSON list of seconds.

bench/bench_store_rebuild.py runs this file in today's tree and in an export
of the code before issue 32 (it uses only helpers both have), alternately:

    python -m bench.first_output_probe --db pg --samples 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services.common.layout import Layout
from tests.scheduler.conftest import STATE, write_config
from tests.support import postgres
from tests.support.system import afe_system
from tests.support.temp_roots import remove_temp_root, temp_root

FIRST = """\
kind: Workflow
name: first
workspace: ws
nodes:
  - {id: first, run: "echo go"}
"""


async def _one(stub) -> float:
    t0 = time.monotonic()
    t = await stub.CreateTicket(pb.CreateTicketRequest(workflow="first", title="first", principal="bench"))
    took = -1.0
    async for ev in stub.WatchTicket(pb.WatchTicketRequest(id=t.id, from_seq=1, follow=True)):
        if ev.type == "node.output" and took < 0:
            took = time.monotonic() - t0
    t = await stub.GetTicket(pb.GetTicketRequest(id=t.id))   # the stream ended: the ticket did
    if STATE[t.state] != "succeeded" or took < 0:
        raise RuntimeError(f"the first-output ticket ended {STATE[t.state]} without output: {t.error}")
    return took


async def measure(db: str, samples: int) -> list[float]:
    root = temp_root("afe-fo-")
    server = postgres.start_server() if db == "pg" else None
    try:
        url = server.app_url(server.fresh_database()) if server is not None else ""
        cfg = write_config(root, FIRST)
        async with afe_system(cfg, Layout(root / "data", root / "run"), subprocess=True, database_url=url) as s:
            await _one(s.stub)                 # warm: the mirror, the image, the store's first statements
            return [await _one(s.stub) for _ in range(samples)]
    finally:
        if server is not None:
            postgres.stop_server(server)
        remove_temp_root(root)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", choices=("sqlite", "pg"), default="sqlite")
    p.add_argument("--samples", type=int, default=3)
    a = p.parse_args()
    print(json.dumps(asyncio.run(measure(a.db, a.samples))))


if __name__ == "__main__":
    main()
