"""An automation client for afe over gRPC (docs/AUTOMATION.md), using the
generated stubs in services/_gen.

Creates a ticket, follows its events until it waits for approval, prints the
diff, and approves exactly the head SHA it saw (a newer head is refused by
the scheduler, so nothing unseen is merged). Resumes its watch from the next
seq if the stream breaks.

    python examples/automation_client.py --run .afe/run \
        --workspace demo --workflow demo-fix --title "add() subtracts"

Exit codes: 0 approved, 1 the ticket ended without waiting for approval,
2 a call was refused (the message says why).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc as pb_grpc

METADATA_KEY = "x-afe-link"          # the key, hex, as in <run>/automation.key
TERMINAL = {pb.TICKET_STATE_SUCCEEDED, pb.TICKET_STATE_FAILED, pb.TICKET_STATE_CANCELLED}


def connect(run_dir: Path) -> tuple[grpc.Channel, tuple[tuple[str, str], ...]]:
    key = (run_dir / "automation.key").read_text().strip()
    channel = grpc.insecure_channel(f"unix://{(run_dir / 'scheduler.sock').absolute()}")
    return channel, ((METADATA_KEY, key),)


def follow_until_waiting(stub: pb_grpc.SchedulerStub, auth, ticket_id: str) -> pb.Ticket:
    """Watch from seq 1; on a broken stream, watch again from the next seq."""
    next_seq = 1
    while True:
        try:
            for ev in stub.WatchTicket(pb.WatchTicketRequest(id=ticket_id, from_seq=next_seq, follow=True),
                                       metadata=auth):
                next_seq = ev.seq + 1
                payload = json.loads(ev.payload_json or "{}")
                print(f"  #{ev.seq} {ev.type} {payload.get('node', '')}".rstrip(), flush=True)
                if ev.type == "approval.requested":
                    return stub.GetTicket(pb.GetTicketRequest(id=ticket_id), metadata=auth)
            return stub.GetTicket(pb.GetTicketRequest(id=ticket_id), metadata=auth)   # the ticket ended
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise
            print(f"  (stream ended: {exc.code().name}; resuming from seq {next_seq})", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default=".afe/run", help="afe's runtime folder (default .afe/run)")
    p.add_argument("--workspace", default="demo")
    p.add_argument("--workflow", default="demo-fix")
    p.add_argument("--title", default="add() subtracts")
    p.add_argument("--body", default="make the tests pass")
    p.add_argument("--principal", default="automation-example", help="who approves (recorded)")
    args = p.parse_args(argv)

    channel, auth = connect(Path(args.run))
    stub = pb_grpc.SchedulerStub(channel)
    try:
        t = stub.CreateTicket(pb.CreateTicketRequest(workspace=args.workspace, workflow=args.workflow,
                                                     title=args.title, body=args.body,
                                                     principal=args.principal), metadata=auth)
        print(f"created {t.id}", flush=True)
        t = follow_until_waiting(stub, auth, t.id)
        if t.state != pb.TICKET_STATE_WAITING_APPROVAL:
            print(f"{t.id} is {pb.TicketState.Name(t.state)}, not waiting for approval: {t.error}")
            return 1
        diff = stub.GetTicketDiff(pb.GetTicketRequest(id=t.id), metadata=auth)
        print(f"--- diff of {t.id} (head {t.awaiting_sha}) ---")
        print(diff.diff + ("\n[diff truncated]" if diff.truncated else ""))
        approved = stub.ApproveTicket(pb.ApproveTicketRequest(id=t.id, principal=args.principal,
                                                              sha=t.awaiting_sha), metadata=auth)
        print(f"approved {approved.id} at {approved.approval.sha} "
              f"(now {pb.TicketState.Name(approved.state)})", flush=True)
        return 0
    except grpc.RpcError as exc:
        print(f"refused: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    finally:
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
