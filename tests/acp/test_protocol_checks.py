"""Table tests for the two gatekeepers in front of the agent: ACP path
mapping (R17) and JSON-RPC message checks. Pure functions: no Docker."""

from __future__ import annotations

import os

import pytest

from services.common.errors import PermissionDenied
from services.scheduler.acp.paths import workspace_cwd, workspace_relative
from services.scheduler.acp.transport import check_jsonrpc

OK_PATHS = [
    ("/workspace/a.txt", "a.txt"),
    ("/workspace/src/pkg/m.py", "src/pkg/m.py"),
    ("/workspace/dir/", "dir"),
    ("/workspace/..hidden", "..hidden"),
]

REFUSED_PATHS = [
    "/etc/passwd", "/workspace", "/workspace/", "/workspace/../x", "/workspace/a/../../x",
    "/workspace/./a", "/workspace//a", "/workspacex/a", "workspace/a", "a.txt", "../x", "",
    "/workspace/a\x00b", "/workspace/a\\..\\b", "/proc/self/environ", "/workspace/" + "a" * 5000, None, 7,
]


@pytest.mark.parametrize("acp_path, rel", OK_PATHS)
def test_paths_under_workspace_map_to_relative_tool_paths(acp_path, rel):
    assert workspace_relative(acp_path) == rel


@pytest.mark.parametrize("acp_path", REFUSED_PATHS)
def test_r17_paths_outside_workspace_or_with_dot_components_are_refused(acp_path, tmp_path):
    with pytest.raises(PermissionDenied):
        workspace_relative(acp_path)
    # Positive control: the refused strings that are paths really leave the
    # workspace (or name its root) when a naive prefix-strip-and-join is used.
    if isinstance(acp_path, str) and acp_path.startswith("/") and "\x00" not in acp_path \
            and len(acp_path) < 4096 and "\\" not in acp_path and "//" not in acp_path \
            and "/./" not in acp_path:
        ws = tmp_path / "ws"
        naive = os.path.realpath(os.path.join(ws, acp_path.removeprefix("/workspace/").lstrip("/")
                                              if acp_path.startswith("/workspace/") else acp_path))
        assert not naive.startswith(str(ws) + os.sep), acp_path


def test_cwd_may_be_the_workspace_root():
    assert workspace_cwd(None) == "" and workspace_cwd("/workspace") == ""
    assert workspace_cwd("/workspace/src") == "src"
    with pytest.raises(PermissionDenied):
        workspace_cwd("/tmp")


GOOD_MESSAGES = [
    {"jsonrpc": "2.0", "id": 1, "method": "fs/read_text_file", "params": {}},
    {"jsonrpc": "2.0", "id": "a", "result": {}},
    {"jsonrpc": "2.0", "id": 2, "error": {"code": -1, "message": "x"}},
    {"jsonrpc": "2.0", "method": "session/update", "params": {}},
    {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "parse"}},
]

BAD_MESSAGES = [
    ([1, 2], "not a JSON object"),
    ("x", "not a JSON object"),
    ({"id": 1, "result": {}}, "jsonrpc"),
    ({"jsonrpc": "1.0", "id": 1, "result": {}}, "jsonrpc"),
    ({"jsonrpc": "2.0", "id": {"a": 1}, "result": {}}, "id must be"),
    ({"jsonrpc": "2.0", "id": [1], "result": {}}, "id must be"),
    ({"jsonrpc": "2.0", "id": True, "result": {}}, "id must be"),
    ({"jsonrpc": "2.0", "id": "x" * 300, "result": {}}, "longer than 256"),
    ({"jsonrpc": "2.0", "id": 1, "method": 5}, "method must be"),
    ({"jsonrpc": "2.0", "id": 1, "method": ""}, "method must be"),
    ({"jsonrpc": "2.0", "method": "m", "params": 3}, "params must be"),
    ({"jsonrpc": "2.0"}, "neither a request"),
    ({"jsonrpc": "2.0", "id": 1}, "neither result nor error"),
    ({"jsonrpc": "2.0", "id": 1, "error": "boom"}, "error must be an object"),
]


@pytest.mark.parametrize("message", GOOD_MESSAGES)
def test_wellformed_jsonrpc_messages_pass(message):
    assert check_jsonrpc(message) is None


@pytest.mark.parametrize("message, reason", BAD_MESSAGES)
def test_malformed_jsonrpc_messages_are_named(message, reason):
    assert reason in (check_jsonrpc(message) or "")
