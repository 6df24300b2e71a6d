"""R41: what the clean room takes from the base besides `base_paths` — the
harness — made by the real credential broker with real git, one cheat class
at a time. Each head is pushed to the ticket's branch by hand (as a person or
a hostile agent could), so any file can be in it; each cheat is first shown
to reach a checkout made without the defence's input (the positive control:
a verify command that does not name the script, a base without the section),
then shown to be replaced by the base's version and reported."""

from __future__ import annotations

import grpc
import pytest

from services._gen.afe.credentials.v1 import credentials_pb2 as pb
from tests.credentials.conftest import broker_stub, git_plain, local_workspace, make_config

pytestmark = pytest.mark.timeout(60)

TID = "t-0123456789ab"
BASE_FILES = {
    "tests/test_sum.py": "from calc import add\n\ndef test_sum():\n    assert add(1, 1) == 2\n",
    "calc.py": "def add(a, b):\n    return a - b\n",
    "pytest.ini": "[pytest]\ntestpaths = tests\n",
    "pyproject.toml": '[project]\nname = "calc"\ndependencies = []\n\n[tool.pytest.ini_options]\naddopts = "-q"\n',
    "setup.cfg": "[metadata]\nname = calc\n\n[tool:pytest]\nxfail_strict = true\n",
    "package.json": '{\n  "name": "calc",\n  "scripts": {"test": "node test.js"},\n  "dependencies": {}\n}\n',
    "run_tests.sh": "python3 -m pytest\n",
    ".gitattributes": "*.py text eol=lf\n",
}


def _seed(origin) -> str:
    work = origin.parent / "seed"
    git_plain("clone", "-q", str(origin), str(work))
    for path, text in BASE_FILES.items():
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text(text)
    git_plain("add", "-A", cwd=work)
    git_plain("commit", "-qm", "base", cwd=work)
    git_plain("push", "-q", "origin", "HEAD:main", cwd=work)
    return git_plain("rev-parse", "HEAD", cwd=work).stdout.decode().strip()


def _push_head(origin, files: dict[str, bytes | str | None], name: str = "person", ref: str = "") -> str:
    """A head on the ticket's branch: the base with `files` written (None: removed)."""
    work = origin.parent / name
    git_plain("clone", "-q", str(origin), str(work))
    for path, content in files.items():
        target = work / path
        if content is None:
            git_plain("rm", "-q", "-r", path, cwd=work)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    git_plain("add", "-A", "-f", cwd=work)
    git_plain("commit", "-qm", "head", cwd=work)
    git_plain("push", "-q", "-f", "origin", f"HEAD:{ref or 'afe/' + TID}", cwd=work)
    return git_plain("rev-parse", "HEAD", cwd=work).stdout.decode().strip()


async def _verify(stub, sha: str, commands=("python3 -m pytest",), base_paths=("tests/",)):
    return await stub.PrepareVerification(pb.PrepareVerificationRequest(
        ticket_id=TID, workspace="local", sha=sha, base_paths=list(base_paths), commands=list(commands)))


@pytest.fixture
async def room(local_origin, layout):
    base = _seed(local_origin)
    config = make_config(layout.data_dir.parent, local_workspace(local_origin))
    async with broker_stub(config, layout) as (stub, _):
        await stub.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=TID, workspace="local"))
        yield stub, local_origin, layout.workspace(TID + "-verify"), base


CONFTEST_CHEAT = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
                  "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")


async def test_r41_a_root_conftest_that_turns_failures_into_passes_is_not_in_the_clean_room(room):
    stub, origin, verify, base = room
    head = _push_head(origin, {"conftest.py": CONFTEST_CHEAT, "calc.py": "def add(a, b):\n    return a * b\n"})
    r = await _verify(stub, head)
    assert not (verify / "conftest.py").exists()
    assert list(r.harness_changes) == ["conftest.py"] and r.base_sha == base
    assert (verify / "calc.py").read_text().endswith("a * b\n")          # the code under test is the head's


@pytest.mark.parametrize(("path", "cheat", "kept"), [
    ("pytest.ini", "[pytest]\ntestpaths = tests\naddopts = --deselect tests/test_sum.py::test_sum\n", None),
    ("pyproject.toml",
     '[project]\nname = "calc"\ndependencies = ["attrs"]\n\n[tool.pytest.ini_options]\naddopts = "-k not_sum"\n',
     'dependencies = ["attrs"]'),
    ("setup.cfg", "[metadata]\nname = calc2\n\n[tool:pytest]\naddopts = -k not_sum\n", "name = calc2"),
    ("package.json", '{\n  "name": "calc",\n  "scripts": {"test": "echo ok"},\n  "dependencies": {"x": "1"}\n}\n',
     '"x": "1"'),
])
async def test_r41_test_runner_configuration_comes_from_the_base(room, path, cheat, kept):
    stub, origin, verify, _ = room
    head = _push_head(origin, {path: cheat})
    r = await _verify(stub, head)
    assert list(r.harness_changes) == [path]
    text = (verify / path).read_text()
    assert "not_sum" not in text and "--deselect" not in text and "echo ok" not in text
    if kept is not None:              # the rest of a shared file stays the head's (dependencies, metadata)
        assert kept in text
    else:
        assert text == BASE_FILES[path]


async def test_r41_a_head_that_leaves_the_harness_alone_reports_no_change(room):
    """The control of the tests above: an honest fix changes only the code."""
    stub, origin, verify, _ = room
    head = _push_head(origin, {"calc.py": "def add(a, b):\n    return a + b\n"})
    r = await _verify(stub, head, commands=["sh run_tests.sh", "make test", "python3 -m unittest"])
    assert list(r.harness_changes) == [] and list(r.shadowing) == [] and list(r.binary_files) == []
    assert (verify / "calc.py").read_text().endswith("a + b\n")


async def test_r41_a_script_the_verify_command_names_comes_from_the_base(room):
    stub, origin, verify, _ = room
    head = _push_head(origin, {"run_tests.sh": "echo '1 passed in 0.01s'\n"})
    r = await _verify(stub, head, commands=["python3 -m pytest"])          # positive control: not named
    assert (verify / "run_tests.sh").read_text().startswith("echo") and list(r.harness_changes) == []
    r = await _verify(stub, head, commands=["sh ./run_tests.sh"])
    assert (verify / "run_tests.sh").read_text() == BASE_FILES["run_tests.sh"]
    assert list(r.harness_changes) == ["run_tests.sh"]


@pytest.mark.parametrize(("files", "name", "command"), [
    ({"unittest/__init__.py": "", "unittest/__main__.py": "print('OK')\n"}, "unittest/", "python3 -m unittest"),
    ({"json.py": "raise SystemExit(0)\n"}, "json.py", "python3 -m pytest"),
    ({"pytest/__main__.py": "print('3 passed')\n"}, "pytest/", "python3 -m pytest"),
    ({"calcrunner/__main__.py": "print('ok')\n"}, "calcrunner/", "python3 -m calcrunner"),
])
async def test_r41_top_level_names_that_shadow_what_the_command_runs_are_left_out(room, files, name, command):
    stub, origin, verify, _ = room
    head = _push_head(origin, files)
    r = await _verify(stub, head, commands=[command])
    assert list(r.shadowing) == [name]
    assert not (verify / name.rstrip("/")).exists()


async def test_r41_committed_bytecode_never_reaches_the_clean_room(room):
    stub, origin, verify, _ = room
    pyc = b"\x6f\x0d\x0d\x0a" + b"\x01\x00\x00\x00" + b"\x00" * 8 + b"fake code object"   # unchecked-hash header
    head = _push_head(origin, {"__pycache__/calc.cpython-311.pyc": pyc, "calc.pyc": pyc,
                               "calc.py": "def add(a, b):\n    return a - b  # still broken\n"})
    r = await _verify(stub, head)
    assert not (verify / "__pycache__").exists() and not (verify / "calc.pyc").exists()
    assert {"__pycache__/calc.cpython-311.pyc", "calc.pyc"} <= set(r.binary_files)


async def test_r41_the_heads_gitattributes_never_rewrite_files_at_checkout(room):
    stub, origin, verify, _ = room
    head = _push_head(origin, {".gitattributes": "*.py text eol=crlf\ntests/** -text\n"})
    r = await _verify(stub, head)
    assert list(r.harness_changes) == [".gitattributes"]
    assert b"\r\n" not in (verify / "tests" / "test_sum.py").read_bytes()
    assert (verify / ".gitattributes").read_text() == BASE_FILES[".gitattributes"]


async def test_r41_the_head_is_verified_merged_onto_the_current_base(room):
    stub, origin, verify, _ = room
    head = _push_head(origin, {"calc.py": "def add(a, b):\n    return a + b\n"})
    # the base gains a test after the head was made
    newer = _push_head(origin, {"tests/test_more.py": "def test_more():\n    assert False\n"}, name="maintainer",
                       ref="main")
    r = await _verify(stub, head)
    assert r.base_sha == newer and r.sha == head
    assert (verify / "tests" / "test_more.py").exists()                  # the base's new test is there
    assert (verify / "calc.py").read_text().endswith("a + b\n")          # with the head's fix
    # a head that conflicts with the base checks nothing out and names the paths
    clash = _push_head(origin, {"calc.py": "def add(a, b):\n    return b + a\n"}, name="clash")
    git_plain("--git-dir", str(origin), "update-ref", "refs/heads/main", head)
    r = await _verify(stub, clash, base_paths=())
    assert list(r.conflicts) == ["calc.py"] and r.commit == ""


async def test_r41_a_base_path_missing_from_the_base_or_a_pattern_is_refused(room):
    stub, origin, _, _ = room
    head = _push_head(origin, {"calc.py": "def add(a, b):\n    return a + b\n"})
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _verify(stub, head, base_paths=("spec/",))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'spec' is not in main" in e.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _verify(stub, head, base_paths=("tests/*.py",))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is a pattern" in e.value.details() and "name tests/ instead" in e.value.details()


async def test_r41_a_workspaces_verify_harness_extends_what_comes_from_the_base(local_origin, layout):
    _seed(local_origin)
    plain = make_config(layout.data_dir.parent, local_workspace(local_origin))
    extended = make_config(layout.data_dir.parent, local_workspace(local_origin, verify_harness=("ci/*.cfg",)))
    files = {"ci/runner.cfg": "skip = test_sum\n", "calc.py": "def add(a, b):\n    return a * b\n"}
    for config, kept in ((plain, True), (extended, False)):      # the first: the positive control
        async with broker_stub(config, layout) as (stub, _):
            await stub.PrepareWorkspace(pb.PrepareWorkspaceRequest(ticket_id=TID, workspace="local"))
            head = _push_head(local_origin, files, name=f"person-{kept}")
            r = await _verify(stub, head)
            verify = layout.workspace(TID + "-verify")
            assert (verify / "ci" / "runner.cfg").exists() is kept
            assert list(r.harness_changes) == ([] if kept else ["ci/runner.cfg"])
            await stub.ReleaseWorkspace(pb.ReleaseWorkspaceRequest(ticket_id=TID, workspace="local"))
