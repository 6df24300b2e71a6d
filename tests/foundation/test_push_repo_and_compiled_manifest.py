"""The Workspace fields of issue 31 in the manifest: `forge.pushRepo` (a fork
the ticket's branch is pushed to, docs/GITHUB.md) and `allowCompiledPaths`
(where a commit may add compiled files, services/common/provenance/bytecode.py). Each
bad value is refused naming the field and what to write; the JSON Schema of
`afe check --schema` declares both."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config.manifests import load_config
from services.common.errors import ConfigError
from services.common.schema.workspace import WorkspaceManifest, push_url


def _load(tmp: Path, text: str):
    (tmp / "afe.yaml").write_text(text)
    return load_config(tmp).workspaces["shop"]


def _github(push: str, repo: str = "https://github.com/acme/shop.git", forge_type: str = "github") -> str:
    return (f"kind: Workspace\nname: shop\nrepo: {repo}\ntokenEnv: SHOP_TOKEN\n"
            f"forge: {{type: {forge_type}, repo: acme/shop, pushRepo: {push}}}\n")


def _refused(tmp: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(tmp, text)
    return str(info.value)


def test_push_repo_is_loaded(tmp_path):
    ws = _load(tmp_path, _github("afe-bot/shop"))
    assert ws.forge.push_repo == "afe-bot/shop"
    assert _load(tmp_path, _github("afe-bot/shop").replace(", pushRepo: afe-bot/shop", "")).forge.push_repo == ""


@pytest.mark.parametrize(("push", "repo", "forge_type", "says"), [
    ("afe-bot", "https://github.com/acme/shop.git", "github", "write the fork as owner/name"),
    ("'a/b/c'", "https://github.com/acme/shop.git", "github", "write the fork as owner/name"),
    ("ACME/shop", "https://github.com/acme/shop.git", "github", "names forge.repo itself"),
    ("afe-bot/shop", "https://github.com/acme/shop.git", "local", "is for a github forge only"),
    ("afe-bot/shop", "https://git.example.com/shop.git", "github", "needs repo to be an https:// URL ending"),
    ("afe-bot/shop", "repos/shop.git", "github", "needs repo to be an https:// URL"),
])
def test_bad_push_repo_is_refused_naming_the_field(tmp_path, push, repo, forge_type, says):
    message = _refused(tmp_path, _github(push, repo, forge_type))
    assert "afe.yaml#1 forge.pushRepo:" in message and says in message, message


@pytest.mark.parametrize(("repo", "push", "url"), [
    ("https://github.com/acme/shop.git", "afe-bot/shop", "https://github.com/afe-bot/shop.git"),
    ("https://github.com/acme/shop", "afe-bot/fork", "https://github.com/afe-bot/fork"),
    ("https://ghe.example.com:8443/git/acme/shop.git/", "bot/shop", "https://ghe.example.com:8443/git/bot/shop.git"),
    ("https://github.com/shop.git", "bot/shop", None),
    ("http://github.com/acme/shop.git", "bot/shop", None),
])
def test_push_url_keeps_host_and_prefix(repo, push, url):
    assert push_url(repo, push) == url


def test_allow_compiled_paths_is_loaded(tmp_path):
    ws = _load(tmp_path, "kind: Workspace\nname: shop\nrepo: repos/shop.git\n"
                         "allowCompiledPaths: [vendor/lib/, 'web/*.wasm']\n")
    assert ws.allow_compiled_paths == ("vendor/lib/", "web/*.wasm")
    assert _load(tmp_path, "kind: Workspace\nname: shop\nrepo: repos/shop.git\n").allow_compiled_paths == ()


@pytest.mark.parametrize(("value", "says"), [
    ("['/vendor/lib/']", "must be relative to the repository root"),
    ("['../x.so']", "must not contain . or .. components"),
    ("['*']", "would allow compiled files everywhere"),
    ("vendor/", "must be a list"),
    ("['']", "must be a non-empty text value"),
])
def test_bad_allow_compiled_paths_are_refused_naming_the_field(tmp_path, value, says):
    message = _refused(tmp_path, f"kind: Workspace\nname: shop\nrepo: repos/shop.git\nallowCompiledPaths: {value}\n")
    assert "afe.yaml#1 allowCompiledPaths" in message and says in message, message


def test_json_schema_declares_both_fields():
    schema = WorkspaceManifest.model_json_schema()
    assert "allowCompiledPaths" in schema["properties"]
    assert "pushRepo" in schema["$defs"]["ForgeManifest"]["properties"]
