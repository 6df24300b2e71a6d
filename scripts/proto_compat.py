"""The v1 compatibility promise of afe.scheduler.v1, checked against a committed
snapshot of what was published (proto/afe/scheduler/v1/published.json).

    python scripts/proto_compat.py            # exit 1 and list every breaking change
    python scripts/proto_compat.py --write    # refresh the snapshot (refused while anything breaks)

The promise (docs/AUTOMATION.md): within v1, things are only ADDED — messages,
fields, enum values, RPCs. Breaking, and therefore only allowed in a v2
package: removing or renaming a message, enum, service or RPC; removing a
field or an enum value; changing a field's number, name, type, message type
or cardinality (repeated/map); reusing a published field number or enum
number for something else; changing an RPC's request or response type or its
streaming.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "proto" / "afe" / "scheduler" / "v1" / "published.json"

_TYPES = {v: k[len("TYPE_"):].lower() for k, v in descriptor_pb2.FieldDescriptorProto.Type.items()}
_LABELS = {v: k[len("LABEL_"):].lower() for k, v in descriptor_pb2.FieldDescriptorProto.Label.items()}


def _messages(prefix: str, msgs, out: dict[str, Any]) -> None:
    for m in msgs:
        name = f"{prefix}.{m.name}"
        out[name] = {"fields": {f.name: {"number": f.number, "type": _TYPES[f.type],
                                         "type_name": f.type_name.lstrip("."), "label": _LABELS[f.label]}
                                for f in m.field}}
        _messages(name, m.nested_type, out)


def _enums(prefix: str, enums, out: dict[str, Any]) -> None:
    for e in enums:
        out[f"{prefix}.{e.name}"] = {v.name: v.number for v in e.value}


def describe(fdp: descriptor_pb2.FileDescriptorProto) -> dict[str, Any]:
    """The parts of a .proto file the promise covers, as plain JSON."""
    messages: dict[str, Any] = {}
    enums: dict[str, Any] = {}
    _messages(fdp.package, fdp.message_type, messages)
    _enums(fdp.package, fdp.enum_type, enums)
    for m in fdp.message_type:     # nested enums
        _enums(f"{fdp.package}.{m.name}", m.enum_type, enums)
    services = {f"{fdp.package}.{s.name}": {
        r.name: {"input": r.input_type.lstrip("."), "output": r.output_type.lstrip("."),
                 "client_streaming": r.client_streaming, "server_streaming": r.server_streaming}
        for r in s.method} for s in fdp.service}
    return {"file": fdp.name, "package": fdp.package, "services": services, "messages": messages,
            "enums": enums}


def describe_file(fd: FileDescriptor) -> dict[str, Any]:
    fdp = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(fdp)
    return describe(fdp)


def current() -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from services._gen.afe.scheduler.v1 import scheduler_pb2

    return describe_file(scheduler_pb2.DESCRIPTOR)


def breaking_changes(published: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Every way `now` breaks a caller written against `published` (empty: compatible)."""
    out: list[str] = []
    if published["package"] != now["package"]:
        out.append(f"package renamed {published['package']} -> {now['package']}")
    for svc, rpcs in published["services"].items():
        if svc not in now["services"]:
            out.append(f"service {svc} removed")
            continue
        for rpc, sig in rpcs.items():
            new = now["services"][svc].get(rpc)
            if new is None:
                out.append(f"rpc {svc}/{rpc} removed")
                continue
            for key in ("input", "output", "client_streaming", "server_streaming"):
                if sig[key] != new[key]:
                    out.append(f"rpc {svc}/{rpc}: {key} changed {sig[key]} -> {new[key]}")
    for msg, spec in published["messages"].items():
        if msg not in now["messages"]:
            out.append(f"message {msg} removed")
            continue
        fields = now["messages"][msg]["fields"]
        by_number = {f["number"]: name for name, f in fields.items()}
        for name, f in spec["fields"].items():
            new = fields.get(name)
            if new is None:
                holder = by_number.get(f["number"])
                out.append(f"field {msg}.{name} (= {f['number']}) removed"
                           + (f" (its number now belongs to {holder})" if holder else ""))
                continue
            for key in ("number", "type", "type_name", "label"):
                if f[key] != new[key]:
                    out.append(f"field {msg}.{name}: {key} changed {f[key] or '-'} -> {new[key] or '-'}")
    for enum, values in published["enums"].items():
        if enum not in now["enums"]:
            out.append(f"enum {enum} removed")
            continue
        for name, number in values.items():
            new = now["enums"][enum].get(name)
            if new is None:
                out.append(f"enum value {enum}.{name} (= {number}) removed")
            elif new != number:
                out.append(f"enum value {enum}.{name}: number changed {number} -> {new}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="refresh the snapshot (only when nothing breaks)")
    args = p.parse_args(argv)
    now = current()
    published = json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else None
    problems = breaking_changes(published, now) if published else []
    if problems:
        print("afe.scheduler.v1 breaks its published contract (make the change in a v2 package instead):",
              file=sys.stderr)
        for line in problems:
            print(f"  {line}", file=sys.stderr)
        return 1
    if args.write:
        SNAPSHOT.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        print(f"wrote {SNAPSHOT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
