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
  `pytest.toml`, `.pytest.toml` (pytest 9), `tox.ini`, `noxfile.py`,
  `.gitattributes` (it decides how files are written at checkout),
  `Makefile`/`makefile`/`GNUmakefile`, `justfile`, `Taskfile.yml`, the
  configuration files of JavaScript test runners and transpilers (jest,
  vitest/vite, mocha, ava, karma, babel, playwright, cypress), npm's and
  yarn's project settings (`.npmrc`: `node-options` preloads a file into
  every script; `.yarnrc.yml`: `yarnPath` runs a file as yarn), and
  `sitecustomize.py`/`usercustomize.py` and `*.pth` files (Python runs them
  at start-up from a site dir, a committed virtualenv's for one);
- everything in a Python distribution's metadata folder (`*.dist-info/`,
  `*.egg-info/`): pytest loads the `pytest11` entry points of every
  distribution it finds on `sys.path`, and `python3 -m pytest` puts the
  checkout's root there;
- sections of shared files, at any depth (pytest reads the first
  configuration file above the paths it is given, a monorepo has one per
  package): the `tool.pytest*`/`tool.tox` tables of `pyproject.toml`, the
  `[tool:pytest]` section of `setup.cfg`, and the
  `scripts`/`jest`/`mocha`/`ava`/`babel` keys of `package.json` (the rest
  of those files, dependencies among them, stays the head's). Those
  sections are compared as the runners read them (TOML as data, setup.cfg
  headers as pytest's ini reader finds them), and a shared file that is not
  a plain file (a symbolic link) is taken whole from the base;
- every file a verify command names (`sh run_tests.sh`, `python3 scripts/check.py`),
  and the files of a module it runs from the checkout (`python3 -m tools.check`:
  `tools/check.py` or `tools/check/__main__.py`, and the `__init__.py` files of
  its packages);
- what the Workspace's `verifyHarness` patterns add.

The functions here are pure (paths and bytes in, decisions out); the git
side is checkout.py.
"""

from __future__ import annotations

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
    "pytest.toml", ".pytest.toml",                     # pytest 9's own configuration files
    "justfile", "Justfile", ".justfile", "Taskfile.yml", "Taskfile.yaml", "taskfile.yml", "taskfile.yaml",
    ".npmrc", ".yarnrc", ".yarnrc.yml", ".pnpmfile.cjs", "bunfig.toml",
})
# Folders whose every file is harness, at any depth: a distribution's metadata
# (its entry_points.txt registers pytest plugins, loaded from any sys.path entry).
METADATA_SUFFIXES = (".dist-info", ".egg-info")
# ... and by pattern of the name
WHOLE_PATTERNS = (
    "jest.config.*", "vitest.config.*", "vitest.workspace.*", "vite.config.*", ".mocharc.*", "ava.config.*",
    "babel.config.*", ".babelrc.*", "karma.conf.*", "playwright.config.*", "cypress.config.*", "*.mk",
    "*.pth",                   # run by `site` at start-up from a site dir (a committed venv's site-packages)
)

# Shared files at the root whose test sections are harness: name -> how to read them.
PYPROJECT, SETUP_CFG, PACKAGE_JSON = "pyproject.toml", "setup.cfg", "package.json"
SECTION_FILES = (PYPROJECT, SETUP_CFG, PACKAGE_JSON)
PACKAGE_KEYS = ("scripts", "jest", "mocha", "ava", "babel")
_SETUP_SECTIONS = ("tool:pytest",)

# Modules a test command commonly runs besides the standard library's, and the
# modules those runners import before any test (pytest: iniconfig, packaging,
# pluggy, attrs in pytest 7, pygments, exceptiongroup, tomli): `python3 -m pytest`
# puts the checkout's root first on sys.path, so a top-level `iniconfig/` the
# head adds runs inside pytest before its configuration is read.
RUNNER_MODULES = frozenset({"pytest", "_pytest", "py", "pluggy", "nose", "nose2", "tox", "nox", "coverage",
                            "hypothesis", "pip", "setuptools", "iniconfig", "packaging", "attr", "attrs",
                            "pygments", "colorama", "exceptiongroup", "tomli", "more_itertools",
                            "pkg_resources", "xdist", "execnet", "_distutils_hack"})
# ... and plugins of pytest, by the prefix of their modules (pytest_cov, pytest_asyncio, ...)
RUNNER_PREFIXES = ("pytest_", "_pytest")
STANDARD_MODULES = frozenset(sys.stdlib_module_names)

# Programs whose own configuration lives in a harness file already: no file to add for them.
_MAX_COMMAND_PATHS = 200


def is_whole_file(path: str, extra: Iterable[str] = ()) -> bool:
    """A file of the harness taken whole from the base."""
    parts = path.split("/")
    name = parts[-1]
    if name in WHOLE_NAMES or any(fnmatch.fnmatchcase(name, p) for p in WHOLE_PATTERNS):
        return True
    if any(d.endswith(METADATA_SUFFIXES) for d in parts[:-1]):
        return True
    return any(_matches(path, p) for p in extra)


def section_file(path: str) -> str:
    """The kind of shared file whose test sections are harness (its name: pyproject.toml,
    setup.cfg, package.json), at any depth; "" for any other path."""
    name = path.rsplit("/", 1)[-1]
    return name if name in SECTION_FILES else ""


def _matches(path: str, pattern: str) -> bool:
    if pattern.endswith("/"):
        return path.startswith(pattern)
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(path, pattern)
    return path == pattern or path.startswith(pattern.rstrip("/") + "/")


def command_paths(commands: Iterable[str], known: set[str]) -> list[str]:
    """Files of the checkout (`known`, repository-relative) that the commands name:
    `sh run_tests.sh`, `python3 ./scripts/check.py --fast`, `bash -c 'make -f ci.mk'`,
    and those of a module they run from the checkout: `python3 -m tools.check`."""
    out: list[str] = []
    for command in commands:
        candidates = [c for token in _tokens(command) for c in _path_forms(token)]
        candidates += [c for module in run_module_names(command) for c in _module_files(module)]
        for candidate in candidates:
            if candidate in known and candidate not in out:
                out.append(candidate)
        if len(out) >= _MAX_COMMAND_PATHS:
            break
    return out[:_MAX_COMMAND_PATHS]


def _module_files(module: str) -> list[str]:
    """The files `python -m a.b.c` may run from the working directory: a/__init__.py,
    a/b/__init__.py, then a/b/c.py, or the package a/b/c/ (__init__.py, __main__.py)."""
    parts = module.split(".")
    if not all(p.isidentifier() for p in parts):
        return []
    out = ["/".join(parts[:i]) + "/__init__.py" for i in range(1, len(parts))]
    path = "/".join(parts)
    return [*out, path + ".py", path + "/__init__.py", path + "/__main__.py"]


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
    return {m.split(".", 1)[0] for command in commands for m in run_module_names(command)}


def run_module_names(command: str) -> list[str]:
    """The modules a command runs with `python -m X.Y` (whole dotted names)."""
    out: list[str] = []
    words = _tokens(command)
    for i, w in enumerate(words):
        if w == "-m" and i + 1 < len(words):
            out.append(words[i + 1])
        elif w.startswith("-m") and len(w) > 2 and not w.startswith("--"):
            out.append(w[2:])
    return out


def shadowing_names(top_level_added: Iterable[str], commands: Iterable[str],
                    packages: Iterable[str] | None = None) -> list[str]:
    """Of the top-level entries the head adds (names like `unittest`, `unittest.py`, `json/`),
    those that shadow a module the commands run, the test runners' or the standard library's.

    With `packages` (the added folders that hold an `__init__.*`), a folder without one
    shadows no standard module: it is a namespace portion, and Python takes a namespace
    only when no module of that name is found anywhere on sys.path. So a TypeScript
    project's `types/` or a site's `html/` stays in the clean room; a runner's module
    (which may be absent from the image, then a namespace's submodules would be imported)
    and a module a command runs with `-m` are left out either way."""
    ran = RUNNER_MODULES | run_modules(commands)
    shadowed = STANDARD_MODULES | ran
    regular = None if packages is None else set(packages)
    out = []
    for entry in top_level_added:
        name = entry.rstrip("/")
        stem = name
        for suffix in (".py", ".pyc", ".pth", ".so"):
            if name.endswith(suffix):
                stem = name[: -len(suffix)]
                break
        first = stem.split(".", 1)[0]
        runner = stem in ran or first in ran or stem.startswith(RUNNER_PREFIXES)
        if entry.endswith("/") and regular is not None and entry not in regular and not runner:
            continue
        if name.endswith(".pth") or runner or stem in shadowed or first in shadowed:
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


def _toml_header(line: str) -> str | None:
    m = _TOML_HEADER.match(line)
    if not m:
        return None
    name = m.group(1).replace('"', "").replace("'", "").replace(" ", "")
    return name if name.startswith(("tool.pytest", "tool.tox")) else ""


def _ini_header(line: str) -> str | None:
    """A section header as pytest's ini reader (iniconfig) finds one: `[` in the first column
    (an indented line continues a value), a `#` or `;` and what follows left out, `]` last
    (`[tool:pytest] ; note` is a header; a regular expression anchored at the line's end missed it)."""
    line = line.lstrip("\ufeff").rstrip()
    if not line.startswith("["):
        return None
    for c in "#;":
        line = line.split(c, 1)[0].rstrip()
    if not line.endswith("]"):
        return None
    name = line[1:-1].strip()
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
    # the same lines under the same headers are not enough: a TOML table written as dotted keys
    # (`[tool]` then `pytest.ini_options.addopts = ...`) has no header to find
    if htest == btest and equal(head, base or b""):
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
    """The test sections' lines as pytest's ini reader splits them (configparser's reading
    differs: it takes an indented header for a header, iniconfig for a value's continuation)."""
    def lines(data: bytes) -> list[str] | None:
        try:
            return [ln.rstrip() for ln in _split(data.decode("utf-8") if data else "", _ini_header)[1]]
        except UnicodeDecodeError:
            return None
    la, lb = lines(a), lines(b)
    return la is not None and la == lb
