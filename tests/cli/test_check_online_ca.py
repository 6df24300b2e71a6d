"""`afe check --online` reaches a git server whose certificate a private CA
signed when AFE_CA_FILE names that CA, as the credential broker does (so
what the check can read, `afe up` can clone); a wrong AFE_CA_FILE is named.

Positive control: the same check with git run as before (no CA bundle given
to it) fails with a certificate error, with the hint to set AFE_CA_FILE."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from services.cli import repocheck
from services.cli.main import main
from services.common.host.gitcmd import GitRunner
from services.common.secrecy.redact import Redactor
from tests.support.fakes.git_http import GitHttpServer, make_bare_repo
from tests.support.fakes.tls import make_cert

pytestmark = pytest.mark.timeout(120)
TOKEN = "chk-" + "k" * 32


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "served"
    root.mkdir()
    make_bare_repo(root, "origin.git", {"README": "hello\n"}, branch="main")
    tls = make_cert(tmp_path / "tls")                  # self-signed: a CA of its own, in no system store
    with GitHttpServer(root, TOKEN, tls.server_context()) as s:
        yield s, tls.cert_file


def _config(tmp: Path, repo: str) -> Path:
    conf = tmp / "conf"
    conf.mkdir()
    (conf / "afe.yaml").write_text(textwrap.dedent(f"""\
        kind: Workspace
        name: ws
        repo: {repo}
        tokenEnv: CHK_GIT_TOKEN
        baseBranch: main
        ---
        kind: Workflow
        name: wf
        workspace: ws
        nodes:
          - {{id: a, run: "true"}}
        """))
    return conf


def _check(capsys, conf: Path) -> tuple[int, str]:
    code = main(["check", "--config", str(conf), "--online"])
    return code, capsys.readouterr().err


def test_check_online_trusts_the_ca_named_by_afe_ca_file(tmp_path, capsys, monkeypatch, server):
    srv, ca = server
    monkeypatch.setenv("CHK_GIT_TOKEN", TOKEN)
    monkeypatch.setenv("AFE_CA_FILE", str(ca))
    conf = _config(tmp_path, srv.url("origin.git"))
    code, err = _check(capsys, conf)
    assert code == 0, err
    assert srv.token_in_authorization()                 # git really asked the server, with the token


def test_positive_control_git_without_the_ca_bundle_fails_on_the_certificate(tmp_path, capsys, monkeypatch,
                                                                             server):
    srv, ca = server
    monkeypatch.setenv("CHK_GIT_TOKEN", TOKEN)
    monkeypatch.setenv("AFE_CA_FILE", str(ca))
    # The old construction: AFE_CA_FILE was not handed to git.
    monkeypatch.setattr(repocheck, "git_runner", lambda home, environ: GitRunner(home, Redactor(), timeout_s=60))
    code, err = _check(capsys, _config(tmp_path, srv.url("origin.git")))
    assert code == 1 and "certificate" in err and "set AFE_CA_FILE" in err, err


def test_check_online_names_an_afe_ca_file_that_is_not_a_file(tmp_path, capsys, monkeypatch, server):
    srv, _ = server
    monkeypatch.setenv("CHK_GIT_TOKEN", TOKEN)
    monkeypatch.setenv("AFE_CA_FILE", str(tmp_path / "no-such-ca.pem"))
    code, err = _check(capsys, _config(tmp_path, srv.url("origin.git")))
    assert code == 1 and f"AFE_CA_FILE={tmp_path / 'no-such-ca.pem'} is not a file" in err, err
