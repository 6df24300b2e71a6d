"""Refusals say why and every egress request is recorded (R44): the
`egress.denied` event lists each refused request (method, host, path
without its query, why, the rule, count), the pull request's section says
the same escaped, and the signed run record holds every request, allowed or
refused, with the path only as a digest, and the Workspace's rules."""

from __future__ import annotations

import json

from services._gen.afe.sandbox.v1 import sandbox_pb2 as spb
from services.common.config.manifests import load_config
from services.common.provenance import attestation
from services.scheduler.sandboxes import egress_report
from services.scheduler.store.base import WAITING_APPROVAL
from services.scheduler.store.run_records import REQUEST

from .test_r42_run_record import WORKFLOWS, _key

SECRET_PATH = "/-/user/org.couchdb.user:exfil-token-9f8e7d"
REQUESTS = [
    spb.EgressRequest(method="GET", host="registry.npmjs.org", path="/demo-pkg", path_sha256="a" * 64, status=200,
                      rule="read-only", bytes_out=400, bytes_in=1200, count=3),
    spb.EgressRequest(method="PUT", host="registry.npmjs.org", path=SECRET_PATH, path_sha256="b" * 64,
                      status=403, denied=True, reason="method", rule="read-only", bytes_out=5000, bytes_in=480,
                      count=2),
    spb.EgressRequest(method="CONNECT", host="pypi.org", status=200, bytes_out=700, bytes_in=90000, count=1),
]


async def test_r44_refusals_in_the_event_and_every_request_in_the_signed_record(harness, tmp_path):
    h = harness(WORKFLOWS)
    cfg = tmp_path / "cfg"
    text = (cfg / "afe.yaml").read_text().replace(
        "  image: afe/sandbox:latest\n",
        "  image: afe/sandbox:latest\n  egress: [pypi.org, {host: registry.npmjs.org, preset: read-only}]\n")
    (cfg / "afe.yaml").write_text(text)
    h.config = load_config(cfg)
    await h.start()
    tid = h.create("review")
    h.sandbox.denied[tid] = [("registry.npmjs.org", 2)]
    h.sandbox.allowed[tid] = [("registry.npmjs.org", 3), ("pypi.org", 1)]
    h.sandbox.requests[tid] = REQUESTS
    t = await h.until(tid, (WAITING_APPROVAL,))
    # the event: each refused request, with its path (never a query) and the rule that refused it
    (_, event), *_ = h.events(tid, egress_report.EVENT)
    assert event["requests"] == [{"method": "PUT", "host": "registry.npmjs.org", "path": SECRET_PATH,
                                  "reason": "method", "rule": "read-only", "count": 2}]
    # the record: every request, allowed or refused, the path as a digest only, and the rules
    rec = h.store.run_records.run_record(tid, t.awaiting_sha, REQUEST)
    statement = attestation.verify(json.loads(rec.envelope), await _key(h), t.awaiting_sha).statement
    egress = statement["predicate"]["egress"]
    assert egress["requests"] == [          # the refused first
        {"method": "PUT", "host": "registry.npmjs.org", "path_sha256": "b" * 64, "status": 403, "denied": True,
         "reason": "method", "rule": "read-only", "bytes_out": 5000, "bytes_in": 480, "count": 2},
        {"method": "GET", "host": "registry.npmjs.org", "path_sha256": "a" * 64, "status": 200, "denied": False,
         "reason": "", "rule": "read-only", "bytes_out": 400, "bytes_in": 1200, "count": 3},
        {"method": "CONNECT", "host": "pypi.org", "path_sha256": "", "status": 200, "denied": False,
         "reason": "", "rule": "", "bytes_out": 700, "bytes_in": 90000, "count": 1}]
    assert egress["requests_truncated"] is False and egress["requests_omitted"] == {"entries": 0, "requests": 0}
    assert egress["rules"] == [{"host": "registry.npmjs.org", "name": "read-only", "methods": ["GET", "HEAD"],
                                "paths": [], "ignore_case": False}]
    assert egress["allowed"] == ["pypi.org", "registry.npmjs.org"]
    assert "exfil-token" not in rec.envelope and "exfil-token" not in json.dumps(statement)


def test_r44_the_pull_request_names_refused_requests_by_rule_never_their_path():
    hostile = "/`](https://phish.example)<img src=x>/exfil-token-9f8e7d"
    r = spb.DeniedEgressResponse(hosts=[spb.DeniedHost(host="registry.npmjs.org", count=3)], requests=[
        spb.EgressRequest(method="PUT", host="registry.npmjs.org", path="/demo-pkg", status=403, denied=True,
                          reason="method", rule="read-only", count=1),
        spb.EgressRequest(method="POST", host="registry.npmjs.org", path=hostile, status=403, denied=True,
                          reason="path", rule="sandbox.egress[2]", count=2),
        spb.EgressRequest(method="POST", host="registry.npmjs.org", path="/other", status=403, denied=True,
                          reason="path", rule="sandbox.egress[2]", count=1),
        spb.EgressRequest(method="GET", host="registry.npmjs.org", path="/ok", status=200, count=9)])
    data = egress_report.payload(r)
    assert [q["path"] for q in data["requests"]] == ["/demo-pkg", hostile.replace(" ", ""), "/other"]  # the event has them
    text = egress_report.section(data)
    assert "- `PUT registry.npmjs.org` refused by `read-only` (method; 1 time)" in text
    assert "- `POST registry.npmjs.org` refused by `sandbox.egress[2]` (path; 3 times)" in text
    for leak in ("exfil-token", "phish", "<img", "/demo-pkg", "/ok"):
        assert leak not in text


def test_r44_a_record_lists_the_refused_first_and_counts_what_it_leaves_out():
    from services.common.config.model import Workspace
    from services.scheduler.executor.nodes.run_statement import EGRESS_REQUESTS_KEPT, _egress
    allowed = [{"method": "GET", "host": "r.test", "path_sha256": f"{i:064x}", "status": 200, "denied": False,
                "reason": "", "rule": "read-only", "bytes_out": 1, "bytes_in": 2, "count": 2}
               for i in range(EGRESS_REQUESTS_KEPT + 10)]
    refused = {"method": "PUT", "host": "r.test", "path_sha256": "f" * 64, "status": 403, "denied": True,
               "reason": "method", "rule": "read-only", "bytes_out": 9, "bytes_in": 3, "count": 1}
    eg = _egress(Workspace(name="w", repo="/x"), {"all_requests": [*allowed, refused]})
    assert eg["requests"][0] == refused and len(eg["requests"]) == EGRESS_REQUESTS_KEPT
    assert eg["requests_omitted"] == {"entries": 11, "requests": 22}
