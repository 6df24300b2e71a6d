"""Files a runtime loads in place of source: compiled bytes a reviewer cannot read.

A committed `__pycache__/mod.cpython-311.pyc` (with an unchecked hash) is what
Python imports instead of the broken `mod.py` beside it, and the diff shows
only "Binary files differ"; a `.so`, `.class` or `.node` file does the same
for its runtime. `builtin:commit` refuses a change that adds or modifies such
a file unless the Workspace allows its path (`allowCompiledPaths`), and the
clean room (R41) uses the same predicate, so both agree on what counts.

Paths are repository-relative with `/` separators. Suffixes are compared
without regard to case (Windows loads `FOO.DLL` as readily as `foo.dll`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

__all__ = ["BYTECODE_DIRS", "BYTECODE_SUFFIXES", "allowed_by", "check_allow_pattern", "loaded_in_place_of_source"]

# Every file under a directory of this name (any depth) is bytecode.
BYTECODE_DIRS: tuple[str, ...] = ("__pycache__",)

# Suffix -> the runtime that loads such a file instead of (or as well as) source.
BYTECODE_SUFFIXES: dict[str, str] = {
    ".pyc": "CPython bytecode (imported instead of the .py, or without one)",
    ".pyo": "CPython optimized bytecode (Python 2, and older tools)",
    ".pyd": "CPython extension module (Windows)",
    ".so": "shared library / CPython or Ruby extension module (Linux)",
    ".dylib": "shared library (macOS)",
    ".dll": "shared library / .NET assembly (Windows)",
    ".class": "JVM class file",
    ".jar": "JVM archive of class files",
    ".war": "JVM web archive",
    ".o": "object file (linked into a native build)",
    ".a": "static library (linked into a native build)",
    ".node": "Node.js native addon",
    ".wasm": "WebAssembly module",
    ".beam": "Erlang/Elixir BEAM bytecode",
    ".egg": "zipped Python package (importable from sys.path)",
}

# Versioned shared objects: libfoo.so.1, libfoo.so.1.2.3
_VERSIONED_SO = re.compile(r"\.so(\.\d+)+$", re.IGNORECASE)


def loaded_in_place_of_source(path: str) -> bool:
    """True when a runtime would load the file at `path` as compiled code:
    anything under a `__pycache__/` directory, or a name ending in one of
    BYTECODE_SUFFIXES (or `.so.<version>`)."""
    parts = [p for p in path.replace("\\", "/").split("/") if p]
    if not parts:
        return False
    if any(p in BYTECODE_DIRS for p in parts[:-1]):
        return True
    name = parts[-1].lower()
    dot = name.rfind(".")
    if dot > 0 and name[dot:] in BYTECODE_SUFFIXES:
        return True
    return bool(_VERSIONED_SO.search(name))


def check_allow_pattern(pattern: str) -> str | None:
    """Why `pattern` cannot be an entry of a Workspace's allowCompiledPaths,
    or None when it can. An entry is a repository-relative path, a directory
    ending in `/` (everything under it), or a glob with `*`, `?` or `[...]`
    (`*` crosses `/`: `vendor/*.so` allows vendor/a/b.so too)."""
    if not pattern or pattern.strip() != pattern:
        return "is empty or starts or ends with a space; write a path such as vendor/lib/ or assets/*.wasm"
    if pattern.startswith("/") or "\\" in pattern:
        return "must be relative to the repository root, with / between names (vendor/lib/, not /vendor/lib)"
    if any(p in ("..", ".") for p in pattern.rstrip("/").split("/")):
        return "must not contain . or .. components; write the path from the repository root"
    if not pattern.isprintable():
        return "holds a control character; write a plain path"
    if pattern in ("*", "**", "**/*", "*/"):
        return ("would allow compiled files everywhere; name the directories that hold them instead "
                "(e.g. vendor/lib/)")
    return None


def allowed_by(path: str, patterns: Iterable[str]) -> bool:
    """Whether one of the Workspace's allowCompiledPaths covers `path`."""
    for pat in patterns:
        if pat.endswith("/"):
            if path.startswith(pat):
                return True
        elif any(c in pat for c in "*?["):
            if fnmatch.fnmatchcase(path, pat):
                return True
        elif path == pat or path.startswith(pat + "/"):
            return True
    return False
