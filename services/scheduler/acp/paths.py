"""ACP paths -> workspace-relative tool paths.

ACP file paths are absolute paths as the agent sees them inside the
sandbox. Only paths under /workspace name something the engine serves; the
rest of the sandbox filesystem (and the host) is refused here, before the
broker's own checks (R17-R19: `..`, absolute paths and symlinks) apply.
"""

from __future__ import annotations

from services.common.errors import PermissionDenied

WORKSPACE = "/workspace"
MAX_PATH = 4096


def workspace_relative(path: object) -> str:
    """Return the tool path for an ACP path, or raise PermissionDenied.

    `/workspace/a/b` -> `a/b`. Refused: non-strings, relative paths, paths
    outside /workspace, the workspace root itself, and any `..`, `.` or
    empty component (no normalisation: `/workspace/../x` is refused, not
    resolved), NUL bytes and backslashes.
    """
    if not isinstance(path, str) or not path:
        raise PermissionDenied("path must be a non-empty absolute path under /workspace")
    if len(path) > MAX_PATH or "\x00" in path or "\\" in path:
        raise PermissionDenied("path is too long or contains NUL or backslash characters")
    if not path.startswith(WORKSPACE + "/"):
        raise PermissionDenied(f"path {path[:200]!r} is outside /workspace; only /workspace is served")
    rest = path[len(WORKSPACE) + 1:]
    parts = rest.split("/")
    if rest.endswith("/"):
        parts = parts[:-1]
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise PermissionDenied(f"path {path[:200]!r} has an empty, '.' or '..' component")
    return "/".join(parts)


def workspace_cwd(path: object) -> str:
    """Like workspace_relative, but /workspace itself (or None) is the root ''."""
    if path is None or path in (WORKSPACE, WORKSPACE + "/"):
        return ""
    return workspace_relative(path)
