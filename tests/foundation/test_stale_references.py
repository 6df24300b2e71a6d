"""The project's words match its code (issue 36): no docstring, comment,
message or doc names a file, module or function that does not exist.
tests/support/references.py says what counts as a reference. Positive
control: planted stale references of every kind are found, while the same
references written right are not."""

from __future__ import annotations

from tests.support.references import scan_text, stale_references


def test_no_doc_or_docstring_names_a_file_module_or_function_that_does_not_exist():
    stale = stale_references()
    assert not stale, "stale references (fix the words, or the name they point at):\n" + "\n".join(map(str, stale))


PLANTED = {
    # (text, where it is written) -> what is stale in it
    ("The limits (relaylimits.py) hold per ticket.", "services/credentials/relay/server.py"): "relaylimits.py",
    ("See services/credentials/relaylimits.py.", "docs/X.md"): "services/credentials/relaylimits.py",
    ("Built by services.common.grpcutil.create_server.", "services/x.py"): "services.common.grpcutil.create_server",
    ("Raises services.common.errors.NoSuchError.", "services/x.py"): "services.common.errors.NoSuchError",
    ("The root is gateway/main.py's `amain`.", "docs/X.md"): "gateway/main.py::amain",
    ("`services/common/errors.py::Nope` decides.", "docs/X.md"): "services/common/errors.py::Nope",
    ("Per DESIGN §5.", "services/x.py"): "DESIGN §",
    ("Shown by `tests/foundation/test_stale_references.py::test_nothing_...`.", "docs/X.md"):
        "tests/foundation/test_stale_references.py::test_nothing_...",
    ("As NOPE.md says.", "docs/X.md"): "NOPE.md",
    ("`make bench` writes bench/out/NOPE.md.", "docs/X.md"): "bench/out/NOPE.md",
}
RIGHT = [
    ("The limits (limits.py) hold per ticket.", "services/credentials/relay/server.py"),
    ("The signer (records/signing.py) signs.", "services/credentials/broker.py"),
    ("See services/credentials/relay/limits.py and docs/SCALE.md.", "docs/X.md"),
    ("Built by services.common.rpc.grpcutil.create_server.", "services/x.py"),
    ("Raises services.common.errors.Reason.", "services/x.py"),
    ("The root is gateway/main.py's `_main`.", "docs/X.md"),
    ("`services/common/errors.py::AfeError.message` decides.", "docs/X.md"),
    ("Shown by `tests/foundation/test_stale_references.py::test_no_doc_...`.", "docs/X.md"),
    ("The user's conftest.py and the demo's calc.py.", "services/x.py"),
    ("`make bench` writes bench/out/REPORT.md.", "docs/X.md"),
]


def test_planted_stale_references_are_found_and_right_ones_are_not():
    for (text, where), ref in PLANTED.items():
        found = [s.ref for s in scan_text(text, where, python=where.endswith(".py"))]
        assert found == [ref], (text, found)
    for text, where in RIGHT:
        assert scan_text(text, where, python=where.endswith(".py")) == [], text


def test_an_output_a_command_writes_counts_whether_or_not_this_checkout_holds_it(tmp_path):
    """A fresh checkout has no bench/out (CI failed on exactly that): an output
    is judged by the code that writes it, never by what an earlier run left."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "run.py").write_text('report = out_dir / "REPORT.md"\n')
    (tmp_path / "bench" / "out").mkdir()
    (tmp_path / "bench" / "out" / "LEFT.md").write_text("left by an earlier run\n")
    files = ("bench/run.py",)
    assert scan_text("See bench/out/REPORT.md.", "docs/X.md", files=files, root=tmp_path, python=False) == []
    # positive control: a file an earlier run left, that no code writes, is stale
    found = scan_text("See bench/out/LEFT.md.", "docs/X.md", files=files, root=tmp_path, python=False)
    assert [s.ref for s in found] == ["bench/out/LEFT.md"]
