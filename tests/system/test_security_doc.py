"""docs/SECURITY.md stays true: every enforced rule (securitymap.RULES) has a test named after it,
and the page names only tests and code that exist."""

from __future__ import annotations

import pytest

from tests.system import securitymap as sm


@pytest.mark.slow
def test_every_rule_has_a_test_and_the_doc_names_only_real_things():
    found = sm.problems(sm.DOC.read_text(), sm.collect())
    assert not found, "\n".join(found) + "\n(refresh the lists: python -m tests.system.securitymap --write)"


@pytest.mark.slow
def test_positive_control_a_missing_rule_test_is_caught():
    tests = sm.collect()
    tests[7] = []
    assert any(p.startswith("R7: no test") for p in sm.problems(sm.DOC.read_text(), tests))


@pytest.mark.slow
def test_positive_control_a_named_test_that_does_not_exist_is_caught():
    doc = sm.DOC.read_text().replace("<!-- end tests R5 -->",
                                     "- `tests/sandbox/containers/test_container.py::test_r5_no_such_test`\n"
                                     "<!-- end tests R5 -->")
    assert any("test_r5_no_such_test, which does not exist" in p for p in sm.problems(doc, sm.collect()))


@pytest.mark.slow
def test_positive_control_a_named_file_that_does_not_exist_is_caught():
    doc = sm.DOC.read_text() + "\n`services/sandbox/no_such_module.py::enforce`\n"
    assert any("no_such_module.py" in p for p in sm.problems(doc, sm.collect()))


@pytest.mark.slow
def test_positive_control_a_test_listed_under_the_wrong_rule_is_caught():
    tests = sm.collect()
    some = next(t for t in tests[26])
    doc = sm.DOC.read_text().replace("<!-- end tests R5 -->",
                                     f"- `{some[0]}::{some[1]}`\n<!-- end tests R5 -->")
    assert any(p.startswith("R5: lists") for p in sm.problems(doc, tests))


def test_rule_prefixes_are_parsed():
    assert sm.rules_of("test_r1_r2_token_never_in_argv") == [1, 2]
    assert sm.rules_of("test_r19_symlink") == [19]
    assert sm.rules_of("test_helper_r3") == []
