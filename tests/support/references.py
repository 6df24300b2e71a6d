"""Which files, modules and names the project's own words point at, and which
of them do not exist (issue 36: a map that matches the code).

Read from the product's Python files (docstrings, comments and messages
alike: an error that says "see docs/X.md" is a reference too) and from the
docs. A reference is one of:

- a path ending in `.py` or `.md` (`services/x/y.py`, `store/events.py`,
  `docs/SCALE.md`): some file of the repository must end with it. A bare
  `.py` name in code (`limits.py`) means a file of the same process (beside
  it, or in a room of that process); in a doc, any file of the repository;
  a bare `.md` name, one of the project's documents (the top level or docs/);
- a dotted module name under `services.` or `gateway.`
  (`services.common.errors`, `services.common.errors.Reason`): the longest
  prefix that is a module must exist, and a name after it must be defined at
  its top level;
- a name in a file (`path.py::Name`, `path.py::Class.method`,
  `path.py's `name``, `path.py::prefix_...`): the file must exist and
  define it;
- a section of a document (`DESIGN §2`): the document must be the project's.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)*[A-Za-z_][\w-]*\.(?:py|md))(?![\w/])")
_FILE_NAME = re.compile(
    r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)*[A-Za-z_][\w-]*\.py)(?:::|'s `)([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)?)"
    r"(\.\.\.)?")
_DOTTED = re.compile(r"(?<![\w./])((?:services|gateway)(?:\.[A-Za-z_]\w*)+)")
_DOC_SECTION = re.compile(r"\b([A-Z][A-Z-]{2,})(?:\.md)?\s*§")
# Names that stand for files of a user's repository (the demo's calc.py, what a verification's
# harness looks for in the repository under test), not for the project's own files.
USER_FILES = frozenset({
    "conftest.py", "noxfile.py", "setup.py", "sitecustomize.py", "usercustomize.py", "__main__.py",
    "unittest.py", "mod.py", "calc.py", "test_calc.py", "src/app.py", "scripts/check.py", "tools/check.py",
    "tools/check/__main__.py", "a/__init__.py", "a/b/__init__.py", "a/b/c.py", "NOTES.md",
})
# Files of the specifications afe follows (DSSE, in-toto), cited beside their repositories.
SPEC_FILES = frozenset({"protocol.md", "spec/v1/statement.md", "resource_descriptor.md", "digest_set.md"})


@dataclass(frozen=True)
class Stale:
    where: str          # file:line
    ref: str
    why: str

    def __str__(self) -> str:
        return f"{self.where}: {self.ref!r}: {self.why}"


# Folders whose files are not the project's (tools, caches, build output, test output).
_SKIP_DIRS = frozenset({".git", ".venv", "build", "node_modules", "__pycache__", "test-artifacts", ".afe",
                        ".mypy_cache", ".ruff_cache", ".pytest_cache", "out"})


# Folders a command writes into (git ignores them, a fresh checkout lacks them): a
# reference to a file in one is right when the code that writes there names the file.
_OUTPUT_DIRS = {"bench/out/": "bench/", "test-artifacts/": "tests/"}


def _written_by_code(ref: str, files: tuple[str, ...], root: Path) -> bool | None:
    """None when `ref` is not in an output folder; else whether its writer names it."""
    for out, writer in _OUTPUT_DIRS.items():
        if ref.startswith(out):
            name = ref[len(out):]
            return any(f.startswith(writer) and f.endswith(".py") and f"\"{name}\"" in _text(root / f)
                       for f in files)
    return None


@functools.cache
def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""


def _in_checkout(ref: str, root: Path) -> bool:
    """A file the checkout holds, never one a command left in an ignored folder."""
    return not (set(Path(ref).parts) & _SKIP_DIRS) and (root / ref).is_file()


@functools.cache
def _tracked() -> tuple[str, ...]:
    """The repository's files, by a walk (no git process: the fast tests start none)."""
    found = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        rel = os.path.relpath(folder, ROOT)
        found += [n if rel == "." else f"{rel}/{n}" for n in names]
    return tuple(sorted(found))


def _ends_with(ref: str, files: tuple[str, ...]) -> list[str]:
    return [f for f in files if f == ref or f.endswith("/" + ref)]


@functools.cache
def _top_names(path: Path) -> frozenset[str]:
    """Names a module defines at its top level, and Class.member for its classes."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return frozenset()
    names: set[str] = set()

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Name):
            return [node.id]
        if isinstance(node, (ast.Tuple, ast.List)):
            return [n for e in node.elts for n in targets(e)]
        return []

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(f"{node.name}.{sub.name}")
                    elif isinstance(sub, ast.AnnAssign):
                        names.update(f"{node.name}.{t}" for t in targets(sub.target))
                    elif isinstance(sub, ast.Assign):
                        names.update(f"{node.name}.{t}" for tg in sub.targets for t in targets(tg))
        elif isinstance(node, ast.Assign):
            names.update(t for tg in node.targets for t in targets(tg))
        elif isinstance(node, ast.AnnAssign):
            names.update(targets(node.target))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, ast.Assign):
                    names.update(t for tg in sub.targets for t in targets(tg))
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in sub.names)
    return frozenset(names)


def _module_file(dotted: str, root: Path) -> Path | None:
    base = root / dotted.replace(".", "/")
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _process_dir(here: str) -> str:
    """`services/credentials` for a file under it; `gateway` for the gateway's."""
    parts = here.split("/")
    return "/".join(parts[:2]) if parts[0] == "services" and len(parts) > 2 else parts[0]


def _check_path(ref: str, here: str, files: tuple[str, ...], root: Path, python: bool) -> str | None:
    if ref in USER_FILES or ref in SPEC_FILES:
        return None
    if "/" not in ref:
        if ref.endswith(".md"):
            return None if (ref in files or f"docs/{ref}" in files) else "no such document in the project"
        sibling = str(Path(here).parent / ref) if Path(here).parent != Path(".") else ref
        if sibling in files:
            return None
        if python:
            # a bare name in code means a file of the same process (a sibling, or a room beside it)
            scope = _process_dir(here) + "/"
            if any(f.startswith(scope) and f.endswith("/" + ref) for f in files):
                return None
            return f"no such file in {scope} (name its folder if it lives elsewhere)"
        if _ends_with(ref, files):
            return None
        return "no such file in the repository"
    written = _written_by_code(ref, files, root)
    if written is not None:
        return None if written else "an output no code writes (the folder is made by a command)"
    if _ends_with(ref, files) or _in_checkout(ref, root):
        return None
    return "no such file in the repository"


def _resolve(ref: str, here: str, files: tuple[str, ...], root: Path) -> Path | None:
    if "/" not in ref:
        cand = Path(here).parent / ref
        return root / cand if (root / cand).is_file() else None
    found = _ends_with(ref, files)
    return root / found[0] if len(found) == 1 else (root / ref if (root / ref).is_file() else None)


def _check_dotted(ref: str, root: Path) -> str | None:
    parts = ref.split(".")
    for n in range(len(parts), 0, -1):
        mod = _module_file(".".join(parts[:n]), root)
        if mod is None:
            continue
        rest = parts[n:]
        if not rest or (n == 1 and len(parts) == 2):
            return None     # a module, or `gateway.env` (a file name in prose)
        name = ".".join(rest[:2])
        if name in _top_names(mod) or rest[0] in _top_names(mod):
            return None
        # `services.x.y.py` is a path written with dots, and a submodule of a package may be
        # named without being imported in its __init__
        if rest[0] == "py" or _module_file(".".join(parts[: n + 1]), root) is not None:
            return None
        return f"{'.'.join(parts[:n])} defines no {rest[0]}"
    return None if len(parts) <= 2 else "no such module"   # `services.x`: a folder named in prose


def scan_text(text: str, here: str, *, files: tuple[str, ...] | None = None, root: Path = ROOT,
              python: bool = True) -> list[Stale]:
    """The stale references in `text` (the content of the file `here`, relative to `root`)."""
    files = _tracked() if files is None else files
    out: list[Stale] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{here}:{lineno}"
        for m in _PATH.finditer(line):
            why = _check_path(m.group(1), here, files, root, python)
            if why:
                out.append(Stale(where, m.group(1), why))
        for m in _FILE_NAME.finditer(line):
            path = _resolve(m.group(1), here, files, root)
            if path is None or path.suffix != ".py":
                continue        # the path itself is reported above
            name, names = m.group(2), _top_names(path)
            if m.group(3):      # `test_r6_r7_...`: a prefix of names
                if not any(n.startswith(name) for n in names):
                    out.append(Stale(where, f"{m.group(1)}::{name}...", f"{m.group(1)} defines no {name}..."))
                continue
            if name not in names and name.split(".")[0] not in names:
                out.append(Stale(where, f"{m.group(1)}::{name}", f"{m.group(1)} defines no {name}"))
        for m in _DOC_SECTION.finditer(line):
            doc = f"{m.group(1)}.md"
            if doc not in files and f"docs/{doc}" not in files:
                out.append(Stale(where, m.group(0), f"the project has no {doc}"))
        if python or "services." in line or "gateway." in line:
            for m in _DOTTED.finditer(line):
                ref = m.group(1).rstrip(".")
                why = _check_dotted(ref, root)
                if why:
                    out.append(Stale(where, ref, why))
    return out


def product_texts(root: Path = ROOT) -> list[tuple[str, str, bool]]:
    """(path, text, is_python) of the files whose words must match the code: the product's
    Python (services/, gateway/), the docs and the README."""
    out = []
    for rel in _tracked():
        if rel.startswith("services/_gen/"):
            continue
        is_py = rel.endswith(".py") and rel.startswith(("services/", "gateway/"))
        is_doc = rel.endswith(".md") and (rel.startswith("docs/") or "/" not in rel)
        if is_py or is_doc:
            out.append((rel, (root / rel).read_text(encoding="utf-8"), is_py))
    return out


def stale_references(root: Path = ROOT) -> list[Stale]:
    found: list[Stale] = []
    for rel, text, is_py in product_texts(root):
        found += scan_text(text, rel, root=root, python=is_py)
    return found
