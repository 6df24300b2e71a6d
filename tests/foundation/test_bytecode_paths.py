"""services/common/provenance/bytecode.py: which paths a runtime loads in place of source,
and which entries a Workspace's allowCompiledPaths accepts."""

from __future__ import annotations

import pytest

from services.common.provenance.bytecode import allowed_by, check_allow_pattern, loaded_in_place_of_source

COMPILED = [
    "__pycache__/mod.cpython-311.pyc", "pkg/__pycache__/x.cpython-312.opt-1.pyc",
    "pkg/__pycache__/notes.txt",           # anything under __pycache__ is the importer's
    "mod.pyc", "mod.pyo", "ext.pyd", "ext.cpython-311-x86_64-linux-gnu.so", "libz.so.1", "libz.so.1.2.13",
    "lib.dylib", "LIB.DLL", "Main.class", "app.jar", "app.war", "x.o", "libx.a", "addon.node",
    "m.wasm", "mod.beam", "dist/pkg.egg",
]
SOURCE = [
    "mod.py", "pkg/__init__.py", "pycache/mod.py", "__pycache__", "README.md", "src/so.py", "notes.so.txt",
    "class.py", ".pyc", "setup.cfg", "a.jar.txt", "docs/x.asm", "data.o.json", "",
]


@pytest.mark.parametrize("path", COMPILED)
def test_compiled_paths_are_loaded_in_place_of_source(path: str) -> None:
    assert loaded_in_place_of_source(path)


@pytest.mark.parametrize("path", SOURCE)
def test_source_paths_are_not(path: str) -> None:
    assert not loaded_in_place_of_source(path)


def test_allow_patterns_match_dirs_files_and_globs() -> None:
    pats = ["vendor/lib/", "tools/helper.jar", "assets/*.wasm", "third_party"]
    assert allowed_by("vendor/lib/a/b.so", pats)
    assert allowed_by("tools/helper.jar", pats)
    assert allowed_by("assets/deep/m.wasm", pats)     # * crosses /
    assert allowed_by("third_party/x/y.so", pats)
    assert not allowed_by("vendor/libz.so", pats)
    assert not allowed_by("tools/helper.jar.bak", pats)
    assert not allowed_by("third_party_x/y.so", pats)
    assert not allowed_by("src/__pycache__/m.pyc", pats)


@pytest.mark.parametrize("pattern", ["", " a", "/abs/", "a/../b", "./a", "*", "**", "a\\b", "a\x00b"])
def test_bad_allow_patterns_are_refused(pattern: str) -> None:
    assert check_allow_pattern(pattern)


@pytest.mark.parametrize("pattern", ["vendor/lib/", "a.so", "assets/*.wasm", "pkg/__pycache__/"])
def test_good_allow_patterns_pass(pattern: str) -> None:
    assert check_allow_pattern(pattern) is None
