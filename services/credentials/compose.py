"""Builds the broker's core from a Config, a Layout and the secrets taken
from the environment. Shared by main.py and the in-process test broker."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from services.common.config.model import Config
from services.common.host.askpass import write_helper
from services.common.host.gitcmd import GitRunner
from services.common.layout import Layout
from services.common.mcpclient import McpClient
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.fencing.database import DatabaseFences, FenceDatabase
from services.credentials.fencing.resource import FenceGuard, Fences
from services.credentials.forges.github import GitHubForge
from services.credentials.forges.local import LocalForge
from services.credentials.mcptools.nodes import ModelNodeMcp
from services.credentials.records.signing import Signer, SigningKey
from services.credentials.relay.server import RelayHub
from services.credentials.workspaces.host import WorkspaceGit

from .broker import CredentialCore
from .httpclient import HttpClient, RetryPolicy
from .models.anthropic import AnthropicProvider
from .models.openai import OpenAIProvider
from .models.replay import ReplayProvider


def private_dir(layout: Layout) -> Path:
    """The broker's own 0700 folder (askpass helper, empty HOME for git)."""
    d = layout.data_dir / "credentials"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def build_core(config: Config, layout: Layout, secrets: dict[str, SecretValue], redactor: Redactor, *,
               ca_file: Path | None = None, proxies: Mapping[str, str] | None = None,
               retry: RetryPolicy | None = None,
               git_timeout_s: float = 600.0, spare_checkouts: bool = True,
               fence_db: FenceDatabase | None = None) -> CredentialCore:
    """`fence_db`: the PostgreSQL store's database, where the fences are checked (fencing/database.py);
    None: the fence file of this machine (fencing/resource.py, a SQLite store)."""
    layout.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    own = private_dir(layout)
    helper = write_helper(own / "bin")
    runner = GitRunner(own / "home", redactor, ca_file=ca_file, proxies=proxies, timeout_s=git_timeout_s)
    git = WorkspaceGit(runner, layout, secrets, helper, config_dir=config.directory,
                       spares_dir=own / "spares" if spare_checkouts else None)
    http = HttpClient(redactor, ca_file=ca_file, proxies=proxies, retry=retry)
    forges = {
        "github": GitHubForge(http, secrets),
        "local": LocalForge(runner, layout.forges_dir, config_dir=config.directory),
    }
    providers = {
        "openai": OpenAIProvider(http, secrets),
        "anthropic": AnthropicProvider(http, secrets),
        "replay": ReplayProvider(),
    }
    relay = RelayHub(config, layout, secrets, redactor, state_dir=own / "relay", ca_file=ca_file, proxies=proxies)
    fences: FenceGuard = DatabaseFences(fence_db) if fence_db is not None else Fences(own / "fences.json")

    def token(name: str) -> str | None:
        held = secrets.get(name)
        return held.reveal() if held is not None else None

    mcp = ModelNodeMcp(config, McpClient(token, ca_file=ca_file, proxies=proxies), fences)
    return CredentialCore(config, git, forges, providers, redactor, relay, report_key_file=own / "report.key",
                          fences=fences, signer=Signer(SigningKey(own / "signing"), git, redactor), mcp=mcp)
