"""R41: ways around the harness a hostile head could take besides the
obvious ones (test_r41_harness_checkout.py), each made by the real credential
broker with real git and then RUN: pytest in the head as pushed (the agent's
own workspace: the positive control, where the cheat turns the failing test
into a pass) and in the clean room (the base's test fails there, as it must).

The base has a broken `add` and a test of it, and no pytest section in its
`pyproject.toml` or `setup.cfg` (the case where a section the head adds has
nothing of the base's to be compared with). Every cheat loads the same
plugin, `evilplug.py` at the root, which turns failures into passes; the
plugin itself is an ordinary source file a reviewer may or may not notice,
so what the clean room must stop is the file that makes pytest load it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from services.credentials.verification import harness
from tests.credentials.conftest import broker_stub, git_plain, local_workspace, make_config

pytestmark = pytest.mark.timeout(120)

TID = "t-0123456789ab"
PLUGIN = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
          "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
BASE_FILES = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "tests/unit/test_sum.py": "from calc import add\n\n\ndef test_sum():\n    assert add(1, 1) == 2\n",
    "pyproject.toml": '[project]\nname = "calc"\nversion = "1"\n',
    "setup.cfg": "[metadata]\nname = calc\n",
    "tools/__init__.py": "",
    "tools/check.py": "import sys\n\nimport pytest\n\nsys.exit(pytest.main(['-q', '-p', 'no:cacheprovider']))\n",
}


class Link(str):
    """A symbolic link to this target, in a head's files."""


def _commit(origin: Path, files: dict[str, str | None], name: str, ref: str, *, orphan: bool = False) -> str:
    work = origin.parent / name
    git_plain("clone", "-q", str(origin), str(work))
    if orphan:
        git_plain("checkout", "-q", "--orphan", "other", cwd=work)
        git_plain("rm", "-q", "-r", "-f", ".", cwd=work)
    for path, content in files.items():
        target = work / path
        if content is None:
            git_plain("rm", "-q", "-r", path, cwd=work)
            continue
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            git_plain("rm", "-q", "-r", path, cwd=work)
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Link):
            target.symlink_to(str(content))
        else:
            target.write_text(content)
    git_plain("add", "-A", "-f", cwd=work)
    git_plain("commit", "-qm", name, cwd=work)
    git_plain("push", "-q", "-f", "origin", f"HEAD:{ref}", cwd=work)
    return git_plain("rev-parse", "HEAD", cwd=work).stdout.decode().strip()


def _head(origin: Path, files: dict[str, str | None], name: str = "agent", **kw) -> tuple[str, Path]:
    """The head on the ticket's branch and the agent's own checkout of it."""
    sha = _commit(origin, files, name, f"afe/{TID}", **kw)
    return sha, origin.parent / name


def _pytest(folder: Path, *args: str, entry_points: bool = False) -> tuple[int, str]:
    """pytest run in `folder` as a verify command runs it (`python3 -m pytest`, the folder as
    the working directory); its exit code and summary line. The plugins installed here are
    not loaded (faster) unless `entry_points`, for a cheat that registers one."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(folder), "PYTHONDONTWRITEBYTECODE": "1",
           **({} if entry_points else {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=folder,
                         check=False, env=env, capture_output=True, text=True, timeout=60)
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    return res.returncode, re.sub(r" in [\d.]+s$", "", lines[-1]) if lines else res.stderr[-300:]


async def _verify(stub, sha: str, commands=("python3 -m pytest -q",), base_paths=("tests/unit/",)):
    return await stub.PrepareVerification(pb.PrepareVerificationRequest(
        ticket_id=TID, workspace="local", sha=sha, base_paths=list(base_paths), commands=list(commands)))


@pytest.fixture
async def room(local_origin, layout):
    _commit(local_origin, BASE_FILES, "seed", "main")
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with broker_stub(config, layout) as (stub, _):
        await stub.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=TID, workspace="local"))
        yield stub, local_origin, layout.workspace(TID + "-verify")


def test_r41_the_base_fails_its_test_and_the_plugin_turns_that_into_a_pass(tmp_path):
    """The control of every test here: the base's test fails, and with the plugin loaded it passes."""
    for path, text in {**BASE_FILES, "evilplug.py": PLUGIN}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    assert _pytest(tmp_path)[0] == 1
    assert _pytest(tmp_path, "-p", "evilplug") == (0, "1 passed")


CHEATS = {
    # pyproject.toml's pytest table as dotted keys of [tool]: no [tool.pytest...] header to see
    "dotted-keys": ({"pyproject.toml": '[project]\nname = "calc"\nversion = "1"\n\n[tool]\n'
                                       'pytest.ini_options.addopts = "-p evilplug"\n'}, ["pyproject.toml"]),
    # ... or at the top of the file, before any table
    "root-dotted-keys": ({"pyproject.toml": 'tool.pytest.ini_options.addopts = "-p evilplug"\n\n[project]\n'
                                            'name = "calc"\nversion = "1"\n'}, ["pyproject.toml"]),
    # setup.cfg's [tool:pytest] with a comment after the header (pytest's ini reader takes it)
    "commented-header": ({"setup.cfg": "[metadata]\nname = calc\n\n[tool:pytest] ;\naddopts = -p evilplug\n"},
                         ["setup.cfg"]),
    # the shared file a symbolic link to a file that is no harness
    "symlinked-setup-cfg": ({"setup.cfg": Link("ci.cfg"), "ci.cfg": "[tool:pytest]\naddopts = -p evilplug\n"},
                            ["setup.cfg"]),
    "symlinked-pyproject": ({"pyproject.toml": Link("ci.toml"),
                             "ci.toml": '[project]\nname = "calc"\nversion = "1"\n\n[tool.pytest.ini_options]\n'
                                        'addopts = "-p evilplug"\n'}, ["pyproject.toml"]),
    # configuration files above the folder pytest is given (here tests/unit, a base path): pytest
    # reads the first it finds walking up, so a monorepo's tests/pyproject.toml counts like the root's
    "nested-pyproject": ({"tests/pyproject.toml": '[tool.pytest.ini_options]\naddopts = "-p evilplug"\n'},
                         ["tests/pyproject.toml"]),
    "nested-setup-cfg": ({"tests/setup.cfg": "[tool:pytest]\naddopts = -p evilplug\n"}, ["tests/setup.cfg"]),
    # pytest 9's own configuration file
    "nested-pytest.toml": ({"tests/pytest.toml": '[pytest]\naddopts = ["-p", "evilplug"]\n'},
                           ["tests/pytest.toml"]),
    # a distribution's metadata at the root: pytest loads the plugins of every distribution on sys.path
    "dist-info": ({"evil-1.dist-info/METADATA": "Metadata-Version: 2.1\nName: evil\nVersion: 1\n",
                   "evil-1.dist-info/entry_points.txt": "[pytest11]\nevil = evilplug\n"},
                  ["evil-1.dist-info/METADATA", "evil-1.dist-info/entry_points.txt"]),
    "egg-info": ({"evil.egg-info/PKG-INFO": "Metadata-Version: 2.1\nName: evil\nVersion: 1\n",
                  "evil.egg-info/entry_points.txt": "[pytest11]\nevil = evilplug\n"},
                 ["evil.egg-info/PKG-INFO", "evil.egg-info/entry_points.txt"]),
}


@pytest.mark.parametrize("cheat", sorted(CHEATS))
async def test_r41_configuration_pytest_reads_that_the_text_surgery_missed_comes_from_the_base(room, cheat):
    stub, origin, verify = room
    files, changed = CHEATS[cheat]
    head, agent = _head(origin, {"evilplug.py": PLUGIN, **files})
    ep = "-info" in cheat
    assert _pytest(agent, "tests/unit", entry_points=ep) == (0, "1 passed")   # positive control: the cheat works
    r = await _verify(stub, head, commands=["python3 -m pytest -q tests/unit"])
    assert _pytest(verify, "tests/unit", entry_points=ep)[0] == 1            # the base's test fails in the clean room
    assert list(r.harness_changes) == changed
    assert (verify / "evilplug.py").is_file()                    # the plugin's source is the head's, shown


async def test_r41_a_head_that_changes_only_the_rest_of_the_shared_files_reports_no_harness_change(room):
    """The control of the test above: the same files, changed where no runner looks."""
    stub, origin, verify = room
    files = {"pyproject.toml": '[project]\nname = "calc"\nversion = "2"\ndependencies = ["attrs"]\n',
             "setup.cfg": "[metadata]\nname = calc\nversion = 2\n",
             "tests/pyproject.toml": '[project]\nname = "calc-tests"\n',
             "web/package.json": '{"name": "web", "dependencies": {"x": "1"}}\n',
             "calcplus/__init__.py": "", "calc.py": "def add(a, b):\n    return a + b\n"}
    head, _ = _head(origin, files)
    r = await _verify(stub, head, commands=["python3 -m pytest -q tests/unit"])
    assert list(r.harness_changes) == [] and list(r.shadowing) == []
    for path, text in files.items():
        assert (verify / path).read_text() == text
    assert _pytest(verify, "tests/unit") == (0, "1 passed")


# loaded by pytest before its configuration: reads the real iniconfig, then names the plugin
SHADOW = ("import importlib, os, sys\nhere = sys.path.pop(0)\ndel sys.modules['iniconfig']\n"
          "sys.modules['iniconfig'] = importlib.import_module('iniconfig')\nsys.path.insert(0, here)\n"
          "os.environ['PYTEST_PLUGINS'] = 'evilplug'\n")


async def test_r41_a_module_pytest_imports_before_any_test_is_not_shadowed_by_the_head(room):
    stub, origin, verify = room
    head, agent = _head(origin, {"evilplug.py": PLUGIN, "iniconfig/__init__.py": SHADOW})
    assert _pytest(agent) == (0, "1 passed")                     # positive control
    r = await _verify(stub, head)
    assert list(r.shadowing) == ["iniconfig/"] and not (verify / "iniconfig").exists()
    assert _pytest(verify)[0] == 1


async def test_r41_a_module_the_command_runs_from_the_checkout_comes_from_the_base(room):
    stub, origin, verify = room
    fake = "print('3 passed in 0.01s')\n"
    head, agent = _head(origin, {"tools/check.py": fake, "tools/__init__.py": "import os\n"})
    assert (agent / "tools" / "check.py").read_text() == fake
    r = await _verify(stub, head, commands=["python3 -m pytest -q"])      # positive control: not run with -m
    assert (verify / "tools" / "check.py").read_text() == fake and list(r.harness_changes) == []
    r = await _verify(stub, head, commands=["python3 -m tools.check"])
    assert (verify / "tools" / "check.py").read_text() == BASE_FILES["tools/check.py"]
    assert list(r.harness_changes) == ["tools/__init__.py", "tools/check.py"]


async def test_r41_setup_cfg_sections_are_split_as_pytests_ini_reader_splits_them(room):
    """An indented `[metadata]` continues the value above it for pytest's ini reader (iniconfig),
    so `addopts` below it is still [tool:pytest]'s; a splitter that took it for a header left the
    test section unchanged and the head's file in the clean room."""
    stub, origin, verify = room
    _commit(origin, {"setup.cfg": "[metadata]\nname = calc\n\n[tool:pytest]\nmarkers =\n    slow\n"}, "maint", "main")
    cheat = "[metadata]\nname = calc\n\n[tool:pytest]\nmarkers =\n    slow\n    [metadata]\naddopts = -p evilplug\n"
    head, agent = _head(origin, {"evilplug.py": PLUGIN, "setup.cfg": cheat})
    assert _pytest(agent) == (0, "1 passed")                     # positive control
    r = await _verify(stub, head)
    assert list(r.harness_changes) == ["setup.cfg"] and "evilplug" not in (verify / "setup.cfg").read_text()
    assert _pytest(verify)[0] == 1


@pytest.mark.parametrize(("path", "harness_file"), [
    (".npmrc", True), ("web/.yarnrc.yml", True), ("justfile", True), ("tests/pytest.toml", True),
    ("vendor/x-1.0.dist-info/entry_points.txt", True), ("x.egg-info/PKG-INFO", True),
    (".venv/lib/python3.11/site-packages/zz.pth", True),
    ("docs/info.txt", False), ("dist-info.md", False), ("src/calc.py", False),
])
def test_r41_harness_files_by_path(path, harness_file):
    assert harness.is_whole_file(path) is harness_file


def test_r41_harness_shadowing_and_modules_a_command_runs():
    added = ["iniconfig/", "packaging/", "pytest_cov/", "attr/", "calcplus/", "site_docs/"]
    assert harness.shadowing_names(added, ["python3 -m pytest"]) == ["attr/", "iniconfig/", "packaging/",
                                                                     "pytest_cov/"]
    known = {"tools/__init__.py", "tools/ci/__init__.py", "tools/ci/run.py", "tools/ci/__main__.py", "other.py"}
    assert sorted(harness.command_paths(["python3 -m tools.ci.run -q", "bash -c 'python -mtools.ci'"], known)) == [
        "tools/__init__.py", "tools/ci/__init__.py", "tools/ci/__main__.py", "tools/ci/run.py"]
    assert harness.command_paths(["python3 -m pytest"], known) == []


def test_r41_a_top_level_folder_shadows_a_standard_module_only_with_an_init(tmp_path):
    """Why such a folder stays in the clean room: Python imports the standard `html`, not a
    folder `html/` without `__init__.py` (a namespace portion); with one (`json/`) it is the folder."""
    (tmp_path / "html").mkdir()
    (tmp_path / "html" / "index.html").write_text("<p>docs</p>\n")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "__init__.py").write_text("")
    res = subprocess.run([sys.executable, "-c", "import html, json; print(html.__file__); print(json.__file__)"],
                         cwd=tmp_path, capture_output=True, text=True, check=True, timeout=30,
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1"})
    html_file, json_file = res.stdout.split()
    assert not html_file.startswith(str(tmp_path)) and json_file == str(tmp_path / "json" / "__init__.py")


async def test_r41_folders_that_shadow_nothing_stay_in_the_clean_room(room):
    stub, origin, verify = room
    head, _ = _head(origin, {"types/index.d.ts": "export type N = number;\n", "html/index.html": "<p>docs</p>\n",
                             "json/__init__.py": "", "colorama/x.py": ""})
    r = await _verify(stub, head)
    assert list(r.shadowing) == ["colorama/", "json/"]      # a package, and a runner's module (maybe absent)
    assert (verify / "types" / "index.d.ts").is_file() and (verify / "html" / "index.html").is_file()
    assert not (verify / "json").exists() and not (verify / "colorama").exists()


async def test_r41_python_bytecode_never_enters_the_clean_room_even_where_compiled_files_are_allowed(
        local_origin, layout):
    """`allowCompiledPaths: [vendor/]` lets the head's vendor/native.so into the clean room (the
    control); a `__pycache__/*.pyc` there would be imported in place of vendor/fmt.py, so it never is."""
    _commit(local_origin, {**BASE_FILES, "vendor/__init__.py": "", "vendor/fmt.py": "def fmt(x):\n    return x\n"},
            "seed", "main")
    ws = local_workspace(local_origin, allow_compiled_paths=("vendor/",))
    async with broker_stub(make_config(layout.data_dir.parent, ws), layout) as (stub, _):
        await stub.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=TID, workspace="local"))
        pyc = "\x6f\x0d\x0d\x0a\x01\x00\x00\x00" + "\x00" * 8 + "code"      # an unchecked-hash header
        head, _ = _head(local_origin, {"vendor/__pycache__/fmt.cpython-311.pyc": pyc, "vendor/fast.pyc": pyc,
                                       "vendor/native.so": "ELF"})
        r = await _verify(stub, head)
        verify = layout.workspace(TID + "-verify")
        assert (verify / "vendor" / "native.so").read_text() == "ELF"
        assert not (verify / "vendor" / "__pycache__").exists() and not (verify / "vendor" / "fast.pyc").exists()
        assert {"vendor/__pycache__/fmt.cpython-311.pyc", "vendor/fast.pyc"} <= set(r.binary_files)
