"""The egress judge (R44) without Docker: what the proxy decides for each
decrypted request to a host with rules. A table of (rules, method, request
target, expected), every encoding of a refused path against every rule,
and positive controls: a naive matcher on the raw path, or a server that
decodes and resolves the path, reads those variants as the refused path."""

from __future__ import annotations

import posixpath
import urllib.parse

import pytest

from services.common.config.egress_rules import preset_rules
from services.sandbox.egress import bump as egress_bump
from services.sandbox.egress import judge as egress_judge
from services.sandbox.egress.judge import Clause, answer, judge, load_rules, normal_path

READ_ONLY = list(egress_bump.clauses(preset_rules("registry.test", "read-only"))["registry.test"])
GIT_FETCH = list(egress_bump.clauses(preset_rules("git.test", "git-fetch"))["git.test"])
PUBLIC_UPLOADS = [Clause("sandbox.egress[2]", ("GET", "PUT"), ("/upload/public/**",))]

CASES = [
    # (rules, method, target, allowed, reason)
    (READ_ONLY, "GET", "/demo-pkg", True, "allow"),
    (READ_ONLY, "HEAD", "/demo-pkg/-/demo-pkg-1.0.0.tgz", True, "allow"),
    (READ_ONLY, "GET", "/@scope%2fname", True, "allow"),               # npm's scoped package name
    (READ_ONLY, "PUT", "/demo-pkg", False, "method"),                  # npm publish
    (READ_ONLY, "POST", "/upload/x", False, "method"),
    (READ_ONLY, "DELETE", "/demo-pkg/-rev/1", False, "method"),
    (READ_ONLY, "get", "/demo-pkg", False, "method"),                  # methods are case-sensitive
    (READ_ONLY, "CONNECT", "/", False, "method"),
    (GIT_FETCH, "GET", "/o/r.git/info/refs?service=git-upload-pack", True, "allow"),
    (GIT_FETCH, "POST", "/o/r.git/git-upload-pack", True, "allow"),
    (GIT_FETCH, "POST", "/git-upload-pack", True, "allow"),            # ** is zero segments too
    (GIT_FETCH, "GET", "/o/r.git/info/refs?service=git-receive-pack", False, "path"),
    (GIT_FETCH, "GET", "/o/r.git/info/refs", False, "path"),
    (GIT_FETCH, "GET", "/o/r.git/info/refs?service=git-upload-pack&service=git-receive-pack", False, "path"),
    (GIT_FETCH, "POST", "/o/r.git/git-receive-pack", False, "path"),   # git push
    (GIT_FETCH, "GET", "/o/r.git/git-upload-pack", False, "path"),     # the method belongs to the path
    (GIT_FETCH, "POST", "/o/r.git/info/refs?service=git-upload-pack", False, "path"),
    (PUBLIC_UPLOADS, "PUT", "/upload/public/a/b", True, "allow"),
    (PUBLIC_UPLOADS, "PUT", "/upload/public", True, "allow"),         # ** is zero segments too
    (PUBLIC_UPLOADS, "PUT", "/upload/publicity/x", False, "path"),
    (PUBLIC_UPLOADS, "PUT", "//upload//public///a", True, "allow"),   # doubled slashes collapse
    (PUBLIC_UPLOADS, "POST", "/upload/public/a", False, "method"),
    ([], "GET", "/", False, "no-rule"),
]


@pytest.mark.parametrize(("rules", "method", "target", "allowed", "reason"), CASES)
def test_r44_judge_table(rules, method, target, allowed, reason):
    v = judge(rules, method, target)
    assert (v.allowed, v.code) == (allowed, reason), v
    if not allowed:
        # the 403 names the request (its path, never its query) and the host's rules
        assert v.message.startswith(f"{urllib.parse.quote(method, safe='')} {target.partition('?')[0]}") or \
            "%" in v.message
        assert "?" not in v.message.split(" refused")[0]
        for c in rules:
            assert c.name in v.message


# Spellings of `PUT /upload/private/x`, which PUBLIC_UPLOADS refuses, that a server
# decoding and resolving the path reads as that very path (or that servers read apart).
PRIVATE = "/upload/private/x"
VARIANTS = [
    "/upload/public/../private/x",
    "/upload/public/%2e%2e/private/x",
    "/upload/public/%2E%2E/private/x",
    "/upload/public/.%2e/private/x",
    "/upload/public%2f..%2fprivate/x",
    "/upload/public/..%2Fprivate/x",
    "/upload/./public/../private/x",
    "/upload/public/..;/private/x",
    "/upload/public/%252e%252e/private/x",
    "/upload/public/..%5cprivate/x",
    "/upload/public/..\\private/x",
    "/upload/public/%c0%ae%c0%ae/private/x",
    "/upload/public/%u002e%u002e/private/x",
    "/upload/public/x%00/../../private/x",
    "/upload/public/x#/../../private/x",
]


@pytest.mark.parametrize("variant", VARIANTS)
def test_r44_encoded_variants_of_a_refused_path_are_refused(variant):
    assert not judge(PUBLIC_UPLOADS, "PUT", PRIVATE).allowed
    v = judge(PUBLIC_UPLOADS, "PUT", variant)
    assert not v.allowed and v.code in ("path", "unclear-path"), v


def test_r44_positive_control_variants_fool_a_raw_matcher_and_reach_the_refused_path():
    """Without the normal form, a matcher on the raw path allows most variants,
    and a server that decodes and resolves dot segments stores them at the
    refused path: the attack the judge stops."""
    pattern = PUBLIC_UPLOADS[0].paths[0]
    raw_allowed = [v for v in VARIANTS if egress_judge.path_matches(pattern, [s for s in v.split("/") if s], "")]
    assert len(raw_allowed) >= 10, raw_allowed
    landed = [v for v in VARIANTS if posixpath.normpath(urllib.parse.unquote(v)) == PRIVATE]
    assert len(landed) >= 6, landed


def test_r44_git_push_spellings_are_refused():
    for target in ("/o/r.git/git%2Dreceive-pack", "/o/r.git/git-upload-pack/../git-receive-pack",
                   "/o/r.git/git-receive-pack/..%2fgit-upload-pack", "/o/r.git/GIT-RECEIVE-PACK",
                   "/o/r.git/git-receive-pack%2f..%2fgit-upload-pack", "/o/r.git//git-receive-pack"):
        assert not judge(GIT_FETCH, "POST", target).allowed, target


def test_r44_protocol_upgrades_are_refused_even_for_an_allowed_request():
    assert judge(READ_ONLY, "GET", "/demo-pkg").allowed
    for upgrade in ("websocket", "h2c"):
        v = judge(READ_ONLY, "GET", "/demo-pkg", upgrade)
        assert (v.allowed, v.code) == (False, "upgrade")
    assert judge(READ_ONLY, "GET", "/demo-pkg", "-").allowed        # squid's "no header"


def test_r44_case_insensitive_paths_only_when_asked():
    sensitive = [Clause("r", ("GET",), ("/Repos/**",))]
    insensitive = [Clause("r", ("GET",), ("/Repos/**",), ignore_case=True)]
    assert not judge(sensitive, "GET", "/repos/x").allowed
    assert judge(insensitive, "GET", "/repos/x").allowed
    assert judge(insensitive, "GET", "/REPOS/x").allowed
    assert normal_path("/A/%41/b//c/", ignore_case=True) == "/a/a/b/c/"


def test_r44_helper_protocol_answers_each_channel_and_never_crashes():
    rules = load_rules(egress_judge.rules_json({"registry.test": READ_ONLY, ".git.test": GIT_FETCH}))
    assert answer(rules, "0 GET registry.test /demo-pkg -") == "0 OK log=allow:allow:read-only"
    out = answer(rules, "7 PUT REGISTRY.test. /demo-pkg -")
    assert out.startswith("7 ERR message=PUT%20%2Fdemo-pkg%20refused") and out.endswith(" log=deny:method:read-only")
    assert answer(rules, "3 POST a.git.test /o/r.git/git-upload-pack -").startswith("3 OK")     # suffix rule
    assert answer(rules, "4 GET other.test / -").startswith("4 ERR")          # no rule names it: refused
    assert answer(rules, "5 GET registry.test %2Fdemo-pkg websocket").startswith("5 ERR")
    assert answer(rules, "").startswith("0 ERR")                              # garbage: refused, no crash
    assert answer(rules, "9").startswith("9 ERR")
    assert " " not in answer(rules, "1 PUT registry.test /a%20b%0d%0ainjected -").split(" ", 3)[2]


def test_r44_judge_source_runs_alone_with_the_standard_library():
    """The proxy runs the judge's source with `python3 -I`: nothing of afe is importable there."""
    import ast
    from pathlib import Path
    tree = ast.parse(Path(egress_judge.__file__).read_text())
    imported = {n.names[0].name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "json", "re", "sys", "urllib", "dataclasses"}, imported
