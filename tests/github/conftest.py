"""The GitHub intake stack, all real but GitHub: the gateway PROCESS (with
the webhook secret), the scheduler's gRPC server and core (in-process, its
engine not started so tickets stay queued), the credential broker's gRPC
server (in-process) and a fake GitHub that checks every request against
GitHub's OpenAPI description. Payloads are GitHub's own examples
(`@octokit/webhooks-examples`), signed here."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from gateway.hooks import sign
from services.common.config.manifests import load_config
from services.common.layout import Layout
from services.common.rpc.links import LinkSecrets, new_secret
from services.common.secrecy.redact import Redactor
from services.common.secrecy.tokenfile import write_token_file
from services.scheduler.app import SchedulerApp, SchedulerOptions, build_app
from tests.gateway.conftest import GatewayProc, start_gateway
from tests.support.credential_broker import credential_broker
from tests.support.fakes.github import FakeGitHub
from tests.support.fakes.openapi import OpenApi
from tests.support.npm import HAVE_NPM, node_modules

NPM_DIR = Path(__file__).with_name("npm")
TOKEN = "ghp_" + "T" * 36
WEBHOOK_SECRET = "whsec-test-" + "s" * 24


@pytest.fixture(scope="session")
def octokit() -> Path:
    if not HAVE_NPM:
        pytest.skip("node and npm are not installed (.ci/run installs Debian's nodejs and npm)")
    return node_modules(NPM_DIR, "@octokit/openapi/package.json") / "@octokit"


@pytest.fixture(scope="session")
def examples(octokit) -> dict[str, list[dict]]:
    """GitHub's webhook examples by event name."""
    index = json.loads((octokit / "webhooks-examples" / "api.github.com" / "index.json").read_text())
    return {e["name"]: e["examples"] for e in index}


@pytest.fixture(scope="session")
def openapi(octokit) -> OpenApi:
    return OpenApi(octokit / "openapi" / "generated" / "api.github.com.json")


def example(examples: dict, event: str, action: str | None = None) -> dict:
    for e in examples[event]:
        if action is None or e.get("action") == action:
            return copy.deepcopy(e)
    raise LookupError(f"no {event}.{action} example")


CONFIG = """
kind: Workspace
name: hello
repo: https://github.com/{repo}.git
tokenEnv: GH_TOKEN
forge: {{type: github, repo: {repo}, baseUrl: "{base}"}}
sandbox: {{egress: [pypi.org]}}
---
kind: Workflow
name: fix
workspace: hello
inputs: [issue, link, who, {{name: ask, default: ""}}]     # ask: empty unless a /afe comment
nodes:
  - id: work
    run: "echo working"
  - id: gate
    uses: builtin:approval
    needs: [work]
---
kind: Workflow
name: other
workspace: hello
nodes:
  - id: anything
    run: "echo other"
---
kind: Model
name: scripted
provider: replay
script: none.yaml
---
kind: Workflow
name: iterate
workspace: hello
nodes:
  - {{id: think, model: scripted, prompt: "Fix it", tools: []}}
  - {{id: gate, uses: builtin:approval, needs: [think]}}
---
kind: Trigger
name: github-fix
workspace: hello
workflow: fix
when: {{labels: [{label}], assignees: [{assignee}], command: /afe}}
inputs: {{issue: body, link: url, who: author, ask: command}}
poll: {poll}
"""


@dataclass
class Stack:
    gateway: GatewayProc
    scheduler: SchedulerApp
    github: FakeGitHub
    layout: Layout
    link: LinkSecrets
    registry: CollectorRegistry
    repo: str
    session: aiohttp.ClientSession
    deliveries: list[str] = field(default_factory=list)

    async def post(self, event: str, payload: dict | bytes, *, delivery: str | None = None,
                   signature: str | None = None, content_type: str = "application/json",
                   signed_body: bytes | None = None) -> tuple[int, dict]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        delivery = delivery or str(uuid.uuid4())
        self.deliveries.append(delivery)
        headers = {"X-GitHub-Event": event, "X-GitHub-Delivery": delivery, "Content-Type": content_type,
                   "User-Agent": "GitHub-Hookshot/test",
                   "X-Hub-Signature-256": signature if signature is not None
                   else sign(WEBHOOK_SECRET.encode(), body if signed_body is None else signed_body)}
        async with self.session.post(self.gateway.url + "/hooks/github", data=body, headers=headers) as r:
            try:
                doc = await r.json(content_type=None)
            except ValueError:
                doc = {}
            return r.status, doc

    def tickets(self):
        return self.scheduler.store.tickets.list(limit=500)

    async def metric(self, outcome: str, reason: str) -> float:
        async with self.session.get(f"http://127.0.0.1:{self.gateway.ops_port}/metrics") as r:
            text = await r.text()
        want = f'afe_gateway_github_deliveries_total{{outcome="{outcome}",reason="{reason}"}}'
        for line in text.splitlines():
            if line.startswith(want):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def write_config(folder: Path, repo: str, base: str, *, label: str, assignee: str, poll: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "none.yaml").write_text("[]\n")       # the replay script of Model scripted (iteration tests)
    (folder / "afe.yaml").write_text(CONFIG.format(repo=repo, base=base, label=label, assignee=assignee,
                                                   poll="true" if poll else "false"))
    return folder


@pytest.fixture
def gateway_flags() -> list[str]:
    """More arguments of the gateway process (a test module may override this fixture)."""
    return []


@pytest.fixture
def settle_s() -> float:
    """The scheduler's settle window for follow-ups (--github-settle-seconds, its default); a test may
    override it. Deliveries a test sends back to back come well within it, even on a busy machine."""
    return 2.0


@pytest.fixture
def gateway_module() -> str:
    """The gateway's module (a positive control may override it with an old code path)."""
    return "gateway.main"


@pytest.fixture
async def stack(examples, openapi, gateway_flags, gateway_module, settle_s):
    labeled = example(examples, "issues", "labeled")
    repo = labeled["repository"]["full_name"]
    assignee = example(examples, "issues", "assigned")["assignee"]["login"]
    root = Path(tempfile.mkdtemp(prefix="afe-gh-", dir="/tmp"))
    layout = Layout(root / "data", root / "run")
    layout.ensure()
    write_token_file(layout.token_file)
    registry = CollectorRegistry()
    async with FakeGitHub(TOKEN, repo=repo, openapi=openapi) as github:
        cfg_dir = write_config(root / "cfg", repo, github.url, label=labeled["label"]["name"], assignee=assignee)
        config = load_config(cfg_dir)
        redactor = Redactor()
        async with credential_broker(config, layout, secrets={"GH_TOKEN": TOKEN},
                                     socket_path=layout.socket("credentials")) as (_, cb_secret):
            link = LinkSecrets(serve={"gateway": new_secret(), "automation": new_secret()},
                               call={"credentials": cb_secret})
            app = build_app(config, layout, link, redactor,
                            SchedulerOptions(recovery_interval=0, github_settle_s=settle_s), registry=registry)
            await app.server.start()   # engine not started
            gw = start_gateway(layout, link.serve["gateway"], config_dir=cfg_dir,
                               env={"AFE_GITHUB_WEBHOOK_SECRET": WEBHOOK_SECRET}, extra=gateway_flags,
                               module=gateway_module)
            try:
                async with aiohttp.ClientSession() as session:
                    yield Stack(gw, app, github, layout, link, registry, repo, session)
            finally:
                gw.stop()
                await app.intake.stop()
                await app.server.stop(0)
                await app.credentials.close()
                await app.sandbox.close()
                app.store.close()
        assert github.undocumented == [], github.undocumented
    shutil.rmtree(root, ignore_errors=True)
