"""What decides how a verification's commands run: the harness (R41).

A head that leaves the code broken could still pass its verification by
changing HOW the tests run rather than the tests: a root `conftest.py` that
turns failures into passes, `addopts` that deselect the failing test, a
`Makefile` or `run_tests.sh` that prints OK, a top-level `unittest/` that
shadows the module `python3 -m unittest` runs. So the clean room takes the
harness from the base branch, like `base_paths`, and every difference the
head makes to it is reported so a person acknowledges it before a merge.

The harness of a checkout is, by path:

- whole files, at any depth: `conftest.py`, `pytest.ini`, `.pytest.ini`,
  `tox.ini`, `noxfile.py`, `.gitattributes` (it decides how files are
  written at checkout), `Makefile`/`makefile`/`GNUmakefile`, the
  configuration files of JavaScript test runners and transpilers (jest,
  vitest/vite, mocha, ava, karma, babel, playwright, cypress), and
  `sitecustomize.py`/`usercustomize.py`;
- sections of shared files at the root: the `tool.pytest*`/`tool.tox`
  tables of `pyproject.toml`, the `[tool:pytest]` section of `setup.cfg`,
  and the `scripts`/`jest`/`mocha`/`ava`/`babel` keys of `package.json`
  (the rest of those files, dependencies among them, stays the head's);
- every file a verify command names (`sh run_tests.sh`, `python3 scripts/check.py`);
- what the Workspace's `verifyHarness` patterns add.

The functions here are pure (paths and bytes in, decisions out); the git
side is verifycheckout.py.
"""

from __future__ import annotations

import configparser
import fnmatch
import json
import re
import shlex
import sys
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

# Whole files at any depth, by name (compared exactly; Linux paths are case-sensitive).
WHOLE_NAMES = frozenset({
    "conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "noxfile.py", ".gitattributes",
    "Makefile", "makefile", "GNUmakefile", "sitecustomize.py", "usercustomize.py",
    ".babelrc", ".mocharc", "karma.conf.js",
})
# ... and by pattern of the name
WHOLE_PATTERNS = (
    "jest.config.*", "vitest.config.*", "vitest.workspace.*", "vite.config.*", ".mocharc.*", "ava.config.*",
    "babel.config.*", ".babelrc.*", "karma.conf.*", "playwright.config.*", "cypress.config.*", "*.mk",
)

# Shared files at the root whose test sections are harness: name -> how to read them.
PYPROJECT, SETUP_CFG, PACKAGE_JSON = "pyproject.toml", "setup.cfg", "package.json"
SECTION_FILES = (PYPROJECT, SETUP_CFG, PACKAGE_JSON)
PACKAGE_KEYS = ("scripts", "jest", "mocha", "ava", "babel")
_SETUP_SECTIONS = ("tool:pytest",)

# Modules a test command commonly runs besides the standard library's.
RUNNER_MODULES = frozenset({"pytest", "_pytest", "py", "pluggy", "nose", "nose2", "tox", "nox", "coverage",
                            "hypothesis", "pip", "setuptools"})
STANDARD_MODULES = frozenset(sys.stdlib_module_names)

# Programs whose own configuration lives in a harness file already: no file to add for them.
_MAX_COMMAND_PATHS = 200


def is_whole_file(path: str, extra: Iterable[str] = ()) -> bool:
    """A file of the harness taken whole from the base."""
    name = path.rsplit("/", 1)[-1]
    if name in WHOLE_NAMES or any(fnmatch.fnmatchcase(name, p) for p in WHOLE_PATTERNS):
        return True
    return any(_matches(path, p) for p in extra)


def _matches(path: str, pattern: str) -> bool:
    if pattern.endswith("/"):
        return path.startswith(pattern)
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(path, pattern)
    return path == pattern or path.startswith(pattern.rstrip("/") + "/")


def command_paths(commands: Iterable[str], known: set[str]) -> list[str]:
    """Files of the checkout (`known`, repository-relative) that the commands name:
    `sh run_tests.sh`, `python3 ./scripts/check.py --fast`, `bash -c 'make -f ci.mk'`."""
    out: list[str] = []
    for command in commands:
        for token in _tokens(command):
            for candidate in _path_forms(token):
                if candidate in known and candidate not in out:
                    out.append(candidate)
        if len(out) >= _MAX_COMMAND_PATHS:
            break
    return out[:_MAX_COMMAND_PATHS]


def _tokens(command: str) -> list[str]:
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    out: list[str] = []
    for w in words:
        out.append(w)
        if " " in w:                       # sh -c '...': the inner command's words too
            out.extend(_tokens(w))
        if "=" in w:                       # --config=ci/pytest.ini, -c=x
            out.append(w.split("=", 1)[1])
    return out


def _path_forms(token: str) -> list[str]:
    token = token.strip()
    if not token or token.startswith(("-", "/")):
        return []
    try:
        p = PurePosixPath(token)
    except ValueError:
        return []
    if ".." in p.parts:
        return []
    s = str(p)
    return [s] if s not in (".", "") else []


def run_modules(commands: Iterable[str]) -> set[str]:
    """The top-level modules the commands run with `python -m X` (X's first part)."""
    out: set[str] = set()
    for command in commands:
        words = _tokens(command)
        for i, w in enumerate(words):
            if w == "-m" and i + 1 < len(words):
                out.add(words[i + 1].split(".", 1)[0])
            elif w.startswith("-m") and len(w) > 2 and not w.startswith("--"):
                out.add(w[2:].split(".", 1)[0])
    return out


def shadowing_names(top_level_added: Iterable[str], commands: Iterable[str]) -> list[str]:
    """Of the top-level entries the head adds (names like `unittest`, `unittest.py`, `json/`),
    those that shadow a module the commands run, the test runners' or the standard library's."""
    shadowed = STANDARD_MODULES | RUNNER_MODULES | run_modules(commands)
    out = []
    for entry in top_level_added:
        name = entry.rstrip("/")
        stem = name
        for suffix in (".py", ".pyc", ".pth", ".so"):
            if name.endswith(suffix):
                stem = name[: -len(suffix)]
                break
        if name.endswith(".pth") or stem in shadowed or stem.split(".", 1)[0] in shadowed:
            out.append(entry)
    return sorted(out)


@dataclass(frozen=True)
class SectionMerge:
    """A shared file's head version with the base's test sections: `content` to check
    out, and whether those sections differ (`changed`)."""
    content: bytes
    changed: bool


def merge_sections(name: str, base: bytes | None, head: bytes | None) -> SectionMerge | None:
    """The head's `name` (pyproject.toml, setup.cfg, package.json) with its test sections
    replaced by the base's. None: the head has no such file (nothing to check out) —
    or the file cannot be read, in which case the caller takes the base's whole file."""
    if head is None:
        return None
    if name == PACKAGE_JSON:
        return _merge_package_json(base, head)
    if name == PYPROJECT:
        return _merge_ini_like(base, head, _toml_header, _pyproject_sections_equal)
    if name == SETUP_CFG:
        return _merge_ini_like(base, head, _ini_header, _setup_sections_equal)
    raise ValueError(name)


def _merge_package_json(base: bytes | None, head: bytes) -> SectionMerge | None:
    try:
        h = json.loads(head)
        b = json.loads(base) if base is not None else {}
    except ValueError:
        return None
    if not isinstance(h, dict) or not isinstance(b, dict):
        return None
    changed = any(h.get(k) != b.get(k) for k in PACKAGE_KEYS)
    if not changed:
        return SectionMerge(head, False)
    merged = {k: v for k, v in h.items() if k not in PACKAGE_KEYS}
    for k in PACKAGE_KEYS:
        if k in b:
            merged[k] = b[k]
    return SectionMerge((json.dumps(merged, indent=2, ensure_ascii=False) + "\n").encode(), True)


_TOML_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_INI_HEADER = re.compile(r"^\s*\[([^\]]+)\]\s*$")


def _toml_header(line: str) -> str | None:
    m = _TOML_HEADER.match(line)
    if not m:
        return None
    name = m.group(1).replace('"', "").replace("'", "").replace(" ", "")
    return name if name.startswith(("tool.pytest", "tool.tox")) else ""


def _ini_header(line: str) -> str | None:
    m = _INI_HEADER.match(line)
    if not m:
        return None
    name = m.group(1).strip()
    return name if name in _SETUP_SECTIONS else ""


def _split(text: str, header: Callable[[str], str | None]) -> tuple[list[str], list[str]]:
    """(lines outside the test sections, lines of the test sections), in order."""
    keep: list[str] = []
    test: list[str] = []
    inside = False
    for line in text.splitlines(keepends=True):
        h = header(line)
        if h is not None:
            inside = bool(h)
        (test if inside else keep).append(line)
    return keep, test


def _merge_ini_like(base: bytes | None, head: bytes, header: Callable[[str], str | None],
                    equal: Callable[[bytes, bytes], bool]) -> SectionMerge | None:
    try:
        htext = head.decode("utf-8")
        btext = base.decode("utf-8") if base is not None else ""
    except UnicodeDecodeError:
        return None
    hkeep, htest = _split(htext, header)
    _, btest = _split(btext, header)
    if htest == btest:
        return SectionMerge(head, False)
    body = "".join(hkeep)
    if body and not body.endswith("\n"):
        body += "\n"
    tail = "".join(btest)
    if tail and body and not body.endswith("\n\n"):
        body += "\n"
    merged = (body + tail).encode()
    # The text surgery must give exactly the base's sections (a table written as
    # dotted keys, a multi-line string holding a "[" line): else the caller takes
    # the base's whole file.
    if not equal(merged, base or b""):
        return None
    return SectionMerge(merged, True)


def _pyproject_sections_equal(a: bytes, b: bytes) -> bool:
    try:
        ta = tomllib.loads(a.decode()) if a else {}
        tb = tomllib.loads(b.decode()) if b else {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return False
    ga, gb = ta.get("tool", {}), tb.get("tool", {})
    return all(ga.get(k) == gb.get(k) for k in ("pytest", "tox"))


def _setup_sections_equal(a: bytes, b: bytes) -> bool:
    def sections(data: bytes) -> dict[str, dict[str, str]] | None:
        cp = configparser.ConfigParser(interpolation=None, strict=False)
        try:
            cp.read_string(data.decode() if data else "")
        except (configparser.Error, UnicodeDecodeError):
            return None
        return {s: dict(cp[s]) for s in _SETUP_SECTIONS if cp.has_section(s)}
    sa, sb = sections(a), sections(b)
    return sa is not None and sa == sb
