"""`afe up --join` and the database link's TLS flags (services/launcher/join.py):
the URL the scheduler and the credential broker get, and the refusals made
before anything starts. The end-to-end recipe is tests/system/test_join_recipe.py."""

from __future__ import annotations

import urllib.parse

import pytest

from services.cli.certs import make_certs
from services.common.errors import ConfigError
from services.launcher import join


@pytest.fixture
def pki(tmp_path):
    make_certs(tmp_path / "pki", [("afe-2", []), ("db", ["localhost"])])
    make_certs(tmp_path / "other", [("afe-2", [])])
    return tmp_path


def _files(base, ca="pki", leaf="pki", key="pki"):
    return join.DatabaseTls(base / ca / "ca.pem", base / leaf / "afe-2.pem", base / key / "afe-2.key")


def test_the_database_url_gets_verified_mutual_tls_and_keeps_its_own_parameters(pki):
    files = _files(pki)
    url = join.with_tls("postgresql://afe:p%40ss@db.internal:5432/afe?connect_timeout=3", files)
    parts = urllib.parse.urlsplit(url)
    assert parts.password == "p%40ss" and parts.hostname == "db.internal" and parts.path == "/afe"
    q = dict(urllib.parse.parse_qsl(parts.query))
    assert q == {"connect_timeout": "3", "sslmode": "verify-full", "sslrootcert": str(files.ca),
                 "sslcert": str(files.cert), "sslkey": str(files.key)}
    assert "sslmode=verify-ca" in join.with_tls("postgresql://afe@db/afe?sslmode=verify-ca", files)
    with pytest.raises(ConfigError, match="asks for sslmode=require, but with --ca the link to the database is "
                                          "verified mutual TLS: remove sslmode"):
        join.with_tls("postgresql://afe@db/afe?sslmode=require", files)


def test_join_refuses_what_cannot_join_before_anything_starts(pki):
    with pytest.raises(ConfigError, match="--join needs the deployment's PostgreSQL database: give --database-url"):
        join.resolve_url({}, None, join=True)
    with pytest.raises(ConfigError, match="--join: a sqlite store is one machine's"):
        join.resolve_url({"AFE_DATABASE_URL": "sqlite:///srv/afe.db"}, None, join=True)
    with pytest.raises(ConfigError, match="holds a password, which every user of this machine can read"):
        join.resolve_url({}, "postgresql://afe:secret-pw@db/afe", join=False)
    with pytest.raises(ConfigError, match="both --database-url and AFE_DATABASE_URL are given and differ"):
        join.resolve_url({"AFE_DATABASE_URL": "postgresql://a@x/afe"}, "postgresql://b@y/afe", join=True)
    env: dict[str, str] = {}
    assert join.resolve_url(env, "postgresql://afe@db/afe", join=True) == "postgresql://afe@db/afe"
    assert env["AFE_DATABASE_URL"] == "postgresql://afe@db/afe"          # what the children get
    assert join.resolve_url({}, None, join=False) == ""                  # without --join: SQLite, as ever
    with pytest.raises(ConfigError, match="--join needs --ca, --tls-key: the link to the database leaves"):
        join.tls_files(pki / "pki" / "afe-2.pem", None, None, join=True)
    assert join.tls_files(None, None, None, join=False) is None


def test_r39_a_machine_certificate_of_another_ca_or_a_key_of_another_is_refused_by_name(pki):
    join.check_signed_by(_files(pki))                                   # positive control: the CA's own
    with pytest.raises(ConfigError, match=r"afe-2.pem \(--tls-cert\) is not signed by the CA .*pki/ca.pem \(--ca\)"):
        join.check_signed_by(_files(pki, leaf="other", key="other"))
    with pytest.raises(ConfigError, match=r"afe-2.key \(--tls-key\) is not the key of .*afe-2.pem"):
        join.check_signed_by(_files(pki, key="other"))
    (pki / "pki" / "afe-2.key").chmod(0o644)
    with pytest.raises(ConfigError, match="readable by other users"):
        join.check_signed_by(_files(pki))


def test_libpq_failures_become_what_to_change_and_never_repeat_its_text():
    db = "the PostgreSQL database afe on db port 5432"
    files = join.DatabaseTls(*(join.Path(p) for p in ("/pki/ca.pem", "/pki/m.pem", "/pki/m.key")))
    cases = {
        'connection failed: SSL error: certificate verify failed': "is not signed by the CA /pki/ca.pem (--ca)",
        'server certificate for "other" does not match host name "db"': "does not name the host in the URL",
        'SSL error: tlsv1 alert unknown ca': "refused this machine's certificate (--tls-cert)",
        'server does not support SSL, but SSL was required': "does not speak TLS",
        'FATAL:  no pg_hba.conf entry for host "10.1.1.1", user "afe"': "has no pg_hba.conf line for this machine",
        'connection refused': f"cannot reach {db}",
    }
    for text, said in cases.items():
        msg = str(join._connect_error(text + " password=hunter2", db, files))
        assert said in msg and "hunter2" not in msg, (text, msg)


def test_a_database_on_another_host_without_verified_tls_is_warned_about(pki):
    warn = join.plain_link_warning
    assert "leaves this machine without verified TLS (R39): give --ca" in warn("postgresql://afe:pw@db.internal/afe")
    assert "pw" not in warn("postgresql://afe:pw@db.internal/afe").split("(R39)")[0]
    assert warn("postgresql://afe@db.internal/afe?sslmode=require")                   # not verified
    assert warn(join.with_tls("postgresql://afe@db.internal/afe", _files(pki))) == ""   # --ca and the files
    for local in ("postgresql://afe@localhost/afe", "postgresql://afe@127.0.0.1:5433/afe",
                  "postgresql://afe@/afe?host=/run/postgresql", "postgresql:///afe"):
        assert warn(local) == "", local
