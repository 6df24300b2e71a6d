"""The code's layout holds (issue: scheduler layout that shows its parts):

- no import circle anywhere in services/ (every import counts: a function's
  lazy import and a TYPE_CHECKING one too, since either is a dependency a
  reader has to follow), checked on the module graph read from the source;
- each scheduler sub-package says in its docstring what it owns and what it
  may import, and the imports between them go the one way the scheduler's
  docstring gives;
- the entry points (services/cli, services/launcher) import only common,
  the gRPC contracts and the launcher, never a broker, the scheduler or the
  gateway (a planted entry point importing a broker is named).

Positive controls: a planted circle (directly and through a package's
__init__) is found, and a planted upward import between the scheduler's
packages is named."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The scheduler's packages, lowest first: a package may import only those before it
# (the wiring at the top, "(top)", may import all).
LAYERS = ["store", "events", "sandboxes", "acp", "executor", "engine", "github"]
MAY_ALSO = {"events": set(), "sandboxes": set()}   # events and sandboxes are side by side


def modules(base: Path, top: str) -> dict[str, tuple[Path, bool]]:
    found = {}
    for p in (base / top).rglob("*.py"):
        if "__pycache__" in p.parts or "_gen" in p.parts:
            continue
        parts = list(p.relative_to(base).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return found


def imports_of(name: str, path: Path, is_pkg: bool, known: Iterable[str]) -> set[str]:
    """The modules of `known` that module `name` imports (`from pkg import mod` names mod)."""
    known = set(known)
    deps: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.Import):
            deps.update(a.name for a in n.names if a.name in known)
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[:len(here) - (n.level - 1)]
                frm = ".".join(here + ([n.module] if n.module else []))
            else:
                frm = n.module or ""
            for a in n.names:
                sub = f"{frm}.{a.name}"
                if sub in known:
                    deps.add(sub)
                elif frm in known:
                    deps.add(frm)
    deps.discard(name)
    return deps


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root, targets in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(targets)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def graph_of(base: Path, top: str) -> dict[str, set[str]]:
    mods = modules(base, top)
    return {m: imports_of(m, p, pkg, mods) for m, (p, pkg) in mods.items()}


@pytest.mark.slow
def test_no_import_circle_in_services():
    found = circles(graph_of(ROOT, "services"))
    assert not found, "import circles (move what both sides need into a module both import):\n" + \
        "\n".join(" <-> ".join(c) for c in found)


def _plant(tmp: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_a_planted_circle_is_found(tmp_path):
    """Positive control: a TYPE_CHECKING import back, and a circle through a package's __init__."""
    _plant(tmp_path, {
        "pkg/__init__.py": "from .b import B\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .core import Core\n",
        "pkg/core.py": "from .a import helper\n",
        "pkg/b.py": "from pkg import c\nB = 1\n",
        "pkg/c.py": "def f():\n    from . import B\n",
        "pkg/ok.py": "from .core import x\n",
    })
    found = circles(graph_of(tmp_path, "pkg"))
    assert ["pkg.a", "pkg.core"] in found
    assert any({"pkg", "pkg.b", "pkg.c"} <= set(c) for c in found), found
    assert not any("pkg.ok" in c for c in found)


def _package_edges(base: Path) -> set[tuple[str, str, str]]:
    """(importing package, imported package, importing module) between the scheduler's sub-packages."""
    sched = base / "services" / "scheduler"
    mods = modules(base, "services")
    edges = set()
    for m, (p, pkg) in mods.items():
        if not m.startswith("services.scheduler."):
            continue
        src = m.split(".")[2] if len(m.split(".")) > 3 or pkg else "(top)"
        if not (sched / src).is_dir():
            src = "(top)"
        for d in imports_of(m, p, pkg, mods):
            parts = d.split(".")
            if parts[:2] != ["services", "scheduler"] or len(parts) < 3:
                continue
            dst = parts[2] if (sched / parts[2]).is_dir() else "(top)"
            if dst != src:
                edges.add((src, dst, m))
    return edges


def upward(edges: set[tuple[str, str, str]]) -> list[str]:
    bad = []
    for src, dst, m in sorted(edges):
        if src == "(top)":
            continue
        if dst == "(top)" or LAYERS.index(dst) > LAYERS.index(src) or \
                (dst in MAY_ALSO and src in MAY_ALSO):
            bad.append(f"{m} ({src}/) imports {dst}/")
    return bad


def test_scheduler_packages_import_one_way():
    bad = upward(_package_edges(ROOT))
    assert not bad, "imports against the scheduler's layering (services/scheduler/__init__.py):\n" + "\n".join(bad)


def test_an_upward_import_is_named(tmp_path):
    """Positive control: the store importing the engine is refused; the engine importing the store is not."""
    _plant(tmp_path, {
        "services/__init__.py": "",
        "services/scheduler/__init__.py": "",
        "services/scheduler/store/__init__.py": "",
        "services/scheduler/store/base.py": "from ..engine import core\n",
        "services/scheduler/engine/__init__.py": "",
        "services/scheduler/engine/core.py": "from ..store.base import X\n",
    })
    bad = upward(_package_edges(tmp_path))
    assert bad == ["services.scheduler.store.base (store/) imports engine/"]


@pytest.mark.parametrize("package", LAYERS)
def test_each_scheduler_package_says_what_it_owns_and_may_import(package):
    doc = ast.get_docstring(ast.parse((ROOT / "services" / "scheduler" / package / "__init__.py").read_text()))
    assert doc, f"services/scheduler/{package}/__init__.py needs a docstring: what it owns, what it may import"
    assert "may import" in doc.lower() or "imports" in doc.lower(), doc


# The processes' rooms (issue 36): each sub-package of these says in its docstring what it holds.
ROOMED = ["services/credentials", "services/sandbox", "services/common"]


def rooms(base: Path) -> list[Path]:
    return sorted(p.parent for top in ROOMED for p in (base / top).glob("*/__init__.py")
                  if "__pycache__" not in p.parts)


def rooms_that_do_not_say_what_they_hold(base: Path) -> list[str]:
    """Rooms without a docstring of at least a sentence (a name alone says nothing new)."""
    bad = []
    for room in rooms(base):
        doc = ast.get_docstring(ast.parse((room / "__init__.py").read_text(encoding="utf-8"))) or ""
        if len(doc.split()) < 6:
            bad.append(room.relative_to(base).as_posix())
    return bad


def test_each_room_of_the_brokers_and_common_says_what_it_holds():
    found = rooms(ROOT)
    assert len(found) >= 15, found      # git, workspaces, forges, relay, ... (a move that lost them)
    bad = rooms_that_do_not_say_what_they_hold(ROOT)
    assert not bad, "rooms whose __init__.py does not say what they hold:\n" + "\n".join(bad)


def test_a_room_that_does_not_say_what_it_holds_is_named(tmp_path):
    """Positive control: a room with no docstring and one with only its name are named; a room
    with a sentence is not."""
    _plant(tmp_path, {
        "services/sandbox/__init__.py": '"""The sandbox broker."""\n',
        "services/sandbox/bare/__init__.py": "",
        "services/sandbox/named/__init__.py": '"""Named."""\n',
        "services/sandbox/good/__init__.py": '"""Commands in a sandbox: the stream and the supervisor."""\n',
    })
    assert rooms_that_do_not_say_what_they_hold(tmp_path) == ["services/sandbox/bare", "services/sandbox/named"]


def test_the_two_supervisors_are_named_for_what_they_supervise():
    """The sandbox's command supervisor and the launcher's process supervisor: no module
    is just `supervisor.py`."""
    plain = [p.relative_to(ROOT).as_posix() for p in (ROOT / "services").rglob("supervisor.py")]
    assert not plain, plain
    assert (ROOT / "services/sandbox/commands/command_supervisor.py").is_file()
    assert (ROOT / "services/launcher/process_supervisor.py").is_file()


# The entry points (issue 36): the CLI and the launcher use only common, the gRPC contracts and the
# launcher (the CLI runs `afe up` through it); a broker or the scheduler is started as a process
# (services/launcher/launch.py MODULES, services/launcher/storecheck.py) or called over its contract
# (services/cli/probebroker.py), never imported. The gateway is not allowed either: nothing in them
# needs it (the CLI speaks to it over HTTP, services/cli/rpc_client.py; the UI token file the CLI writes
# and the gateway reads is common's, services/common/secrecy/tokenfile.py).
ENTRY_POINTS = ["cli", "launcher"]
ENTRY_MAY_IMPORT = ("services.common", "services._gen", "services.launcher", "services.cli")


def _absolute_imports(name: str, path: Path, is_pkg: bool) -> set[str]:
    """Every module name `name` imports (lazy and TYPE_CHECKING ones too), made absolute;
    `from pkg import x` gives pkg.x."""
    found: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.Import):
            found.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom):
            frm = n.module or ""
            if n.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[:len(here) - (n.level - 1)]
                frm = ".".join(here + ([n.module] if n.module else []))
            found.update(f"{frm}.{a.name}" for a in n.names)
    return found


def entry_point_imports_outside(base: Path) -> list[str]:
    """'module imports name' for each import of a product module (services.*, gateway) that an
    entry point may not use."""
    bad = []
    for top in ENTRY_POINTS:
        for m, (p, pkg) in sorted(modules(base, f"services/{top}").items()):
            for dep in sorted(_absolute_imports(m, p, pkg)):
                product = dep.split(".")[0] == "gateway" or dep.startswith("services.")
                if product and not dep.startswith(tuple(f"{ok}." for ok in ENTRY_MAY_IMPORT)):
                    bad.append(f"{m} imports {dep}")
    return bad


def test_entry_points_use_only_common_the_contracts_and_the_launcher():
    found = modules(ROOT, "services/cli")
    assert "services.cli.doctor" in found and "services.launcher.launch" in modules(ROOT, "services/launcher")
    bad = entry_point_imports_outside(ROOT)
    assert not bad, ("the CLI and the launcher use only services.common, the gRPC contracts (services._gen) "
                     "and the launcher; start a broker as a process or call its contract, and move what "
                     "several processes share into services/common:\n" + "\n".join(bad))


def test_an_entry_point_importing_a_broker_is_named(tmp_path):
    """Positive control: a lazy import of the sandbox broker's core, a TYPE_CHECKING one of the
    scheduler's store, a relative reach into the credential broker and an import of the gateway
    are named; common, the contracts, the launcher and a broker's module name as a string are not."""
    _plant(tmp_path, {
        "services/__init__.py": "",
        "services/cli/__init__.py": "",
        "services/cli/bad.py": ("from typing import TYPE_CHECKING\n"
                                "if TYPE_CHECKING:\n    from services.scheduler.store import url\n"
                                "def probe():\n    from services.sandbox.sandboxes import SandboxManager\n"
                                "from ..credentials import git\nimport gateway.app\n"),
        "services/cli/good.py": ("from services.common.layout import Layout\n"
                                 "from services._gen.afe.sandbox.v1 import sandbox_pb2\n"
                                 "from services.launcher.launch import MODULES\nfrom . import bad\n"
                                 "BROKER = 'services.sandbox.main'\n"),
        "services/launcher/__init__.py": "",
        "services/launcher/run.py": "from services import sandbox\n",
    })
    assert entry_point_imports_outside(tmp_path) == [
        "services.cli.bad imports gateway.app",
        "services.cli.bad imports services.credentials.git",
        "services.cli.bad imports services.sandbox.sandboxes.SandboxManager",
        "services.cli.bad imports services.scheduler.store.url",
        "services.launcher.run imports services.sandbox",
    ]
