"""`afe up` on a shared PostgreSQL database, and `afe up --join` (docs/SCALE.md,
"Several machines").

Every machine of a deployment runs its own `afe up` (gateway, scheduler, the
two brokers) on one PostgreSQL database. The link from a machine to the
database leaves the host, so it is mutual TLS with the deployment's own CA
(R39): with a PostgreSQL URL and `--ca`, `--tls-cert`, `--tls-key`, the URL
the scheduler and the credential broker get is the operator's with
`sslmode=verify-full`, `sslrootcert` (the CA), `sslcert` and `sslkey` (this
machine's certificate from `afe certs`) added.

`--join` says "this machine joins a deployment that already runs": it needs
those three files and refuses before anything starts, saying what to
change, when the store is SQLite (one machine's), the URL holds a password
in the command line, the certificate is not the CA's, the database does not
answer or speak TLS, its certificate is not the CA's or does not name its
host, it refuses this machine's certificate, or holds no afe deployment yet.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import AfeError, ConfigError, FailedPrecondition, Unavailable

ENV = "AFE_DATABASE_URL"
PG_SCHEMES = ("postgresql", "postgres")
TLS_PARAMS = ("sslmode", "sslrootcert", "sslcert", "sslkey")
DOC = 'docs/SCALE.md, "Several machines"'


@dataclass(frozen=True)
class DatabaseTls:
    ca: Path
    cert: Path
    key: Path


def resolve_url(environ: MutableMapping[str, str], url_flag: str | None, join: bool) -> str:
    """The store's URL from --database-url or AFE_DATABASE_URL (put into `environ`)."""
    if url_flag:
        try:
            password = urllib.parse.urlsplit(url_flag).password
        except ValueError:
            raise ConfigError("--database-url is not a URL; write postgresql://USER@HOST:PORT/DATABASE") from None
        if password:
            raise ConfigError("--database-url holds a password, which every user of this machine can read in the "
                              "process list: put the whole URL in the AFE_DATABASE_URL environment variable "
                              "instead, or let the database log this machine in by its certificate")
        if environ.get(ENV) and environ[ENV] != url_flag:
            raise ConfigError("both --database-url and AFE_DATABASE_URL are given and differ; give one")
        environ[ENV] = url_flag
    url = environ.get(ENV, "")
    if not join:
        return url
    if not url:
        raise ConfigError("--join needs the deployment's PostgreSQL database: give --database-url "
                          "postgresql://USER@HOST:PORT/DATABASE (the password, if any, in AFE_DATABASE_URL "
                          f"instead); {DOC}")
    if not is_postgresql(url):
        raise ConfigError(f"--join: a {_scheme(url) or 'non-PostgreSQL'} store is one machine's; the machines of a "
                          "deployment share one PostgreSQL database: give --database-url "
                          f"postgresql://USER@HOST:PORT/DATABASE, the one the first machine uses; {DOC}")
    return url


def _scheme(url: str) -> str:
    return url.split(":", 1)[0].strip().lower() if ":" in url else ""


def is_postgresql(url: str) -> bool:
    return _scheme(url) in PG_SCHEMES


def tls_files(cert: Path | None, key: Path | None, ca: Path | None, join: bool) -> DatabaseTls | None:
    """This machine's mutual-TLS files for the database link; --join needs all three."""
    given = {"--ca": ca, "--tls-cert": cert, "--tls-key": key}
    if join and not all(given.values()):
        missing = ", ".join(flag for flag, v in given.items() if v is None)
        raise ConfigError(f"--join needs {missing}: the link to the database leaves this machine, so it "
                          "is mutual TLS (R39) with the deployment CA (--ca, its ca.pem) and this machine's "
                          "certificate and key (`afe certs DIR --name host-2` makes --tls-cert host-2.pem and "
                          f"--tls-key host-2.key); {DOC}")
    if ca is None or cert is None or key is None:
        return None
    files = DatabaseTls(ca, cert, key)
    check_signed_by(files)
    return files


def check_signed_by(files: DatabaseTls) -> None:
    """This machine's certificate is one of the CA's, its key is private and is the certificate's."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization

    from services.common.rpc.tls import TlsFiles

    cert_pem, key_pem, ca_pem = TlsFiles(files.cert, files.key, files.ca).read()   # says which file is wrong
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        ca = x509.load_pem_x509_certificate(ca_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except ValueError:
        raise ConfigError(f"{files.cert}, {files.key} or {files.ca} is not a certificate or key `afe certs` "
                          "makes; make them again") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise ConfigError(f"the certificate {files.cert} (--tls-cert) is not signed by the CA {files.ca} (--ca): "
                          "give the deployment's ca.pem and a certificate made with it (`afe certs DIR --name "
                          "NAME` in the folder that holds the deployment's ca.key)") from None
    if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) \
            != cert.public_key().public_bytes(serialization.Encoding.DER,
                                              serialization.PublicFormat.SubjectPublicKeyInfo):
        raise ConfigError(f"the key {files.key} (--tls-key) is not the key of {files.cert} (--tls-cert): give "
                          "the two files `afe certs` made together (NAME.pem and NAME.key)")


def with_tls(url: str, files: DatabaseTls) -> str:
    """`url` with mutual TLS to the database, verified against the deployment CA."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    mode = dict(query).get("sslmode")
    if mode and mode not in ("verify-full", "verify-ca"):
        raise ConfigError(f"the database URL asks for sslmode={mode}, but with --ca the link to the database is "
                          "verified mutual TLS: remove sslmode from the URL (afe sets verify-full)")
    query = [(k, v) for k, v in query if k not in TLS_PARAMS]
    query += [("sslmode", mode or "verify-full"), ("sslrootcert", str(files.ca)), ("sslcert", str(files.cert)),
              ("sslkey", str(files.key))]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


LOCAL_HOSTS = ("", "localhost", "127.0.0.1", "::1")


def plain_link_warning(url: str) -> str:
    """A warning when the store is a PostgreSQL database on another host reached without
    verified TLS (R39), else ""."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - the store's own check says what is wrong with the URL
        return ""
    hosts = [h.strip() for h in str(params.get("host") or "").split(",")]
    if all(h in LOCAL_HOSTS or h.startswith("/") for h in hosts):
        return ""
    if str(params.get("sslmode") or "") in ("verify-full", "verify-ca"):
        return ""
    return (f"warning: the link to {where(url)} leaves this machine without verified TLS (R39): give --ca, "
            f"--tls-cert and --tls-key ({DOC})")


def where(url: str) -> str:
    """The database as messages name it (never the URL: it may hold a password, R29)."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - its text may quote the URL
        return "the PostgreSQL database"
    return (f"the PostgreSQL database {params.get('dbname') or params.get('user') or ''} on "
            f"{params.get('host') or 'the local socket'} port {params.get('port') or '5432'}")


def check_deployment(url: str, files: DatabaseTls | None, need_deployment: bool = True) -> str:
    """Connect as the scheduler will and (--join, `need_deployment`) find the
    deployment there, or an error that says what to change. Returns the
    database's description."""
    import psycopg

    db = where(url)
    try:
        conn = psycopg.connect(url, autocommit=True, connect_timeout=10)
    except psycopg.Error as exc:
        raise _connect_error(str(exc), db, files) from None
    try:
        found = conn.execute("SELECT to_regclass('schema_version') IS NOT NULL").fetchone()
        version = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone() \
            if found and found[0] else (0,)
    except psycopg.Error as exc:
        raise FailedPrecondition(f"{db} answered but could not be read ({type(exc).__name__}); "
                                 "check that the user in the URL may use it") from None
    finally:
        conn.close()
    if need_deployment and (not version or not version[0]):
        raise FailedPrecondition(f"{db} holds no afe deployment yet: start the first machine "
                                 "without --join on it (it makes the tables), or check the database name in the "
                                 f"URL; {DOC}")
    return db


def _connect_error(text: str, db: str, files: DatabaseTls | None) -> AfeError:
    """libpq's text, classified; never passed on (it may name parameters of the URL)."""
    low = text.lower()
    ca = f" {files.ca}" if files else ""
    if "does not match host name" in low or "does not match host" in low:
        return FailedPrecondition(f"the certificate of {db} does not name the host in the URL: "
                                  "issue the database's certificate for the name machines dial (`afe certs DIR "
                                  "--name db=HOST --force`), or dial the name it has")
    if "certificate verify failed" in low and "alert" not in low:
        return FailedPrecondition(f"the certificate of {db} is not signed by the CA{ca} (--ca): "
                                  "give the deployment's ca.pem, or give the database a certificate of this CA "
                                  "(`afe certs DIR --name db=HOST`; ssl_cert_file and ssl_key_file in "
                                  f"postgresql.conf); {DOC}")
    if "alert unknown ca" in low or "alert bad certificate" in low or "alert certificate" in low \
            or "valid client certificate" in low:
        return FailedPrecondition(f"{db} refused this machine's certificate (--tls-cert): its "
                                  "ssl_ca_file must be the deployment's ca.pem, the one --ca names; "
                                  f"{DOC}")
    if "does not support ssl" in low or "server does not support" in low:
        return FailedPrecondition(f"{db} does not speak TLS: set ssl = on with a certificate of "
                                  f"the deployment CA in its postgresql.conf; {DOC}")
    if "no pg_hba.conf entry" in low:
        return FailedPrecondition(f"{db} has no pg_hba.conf line for this machine: add "
                                  "`hostssl DATABASE USER ADDRESS scram-sha-256 clientcert=verify-ca` (or the "
                                  f"`cert` method) for it; {DOC}")
    if "password authentication failed" in low or "no password supplied" in low:
        return FailedPrecondition(f"{db} refused the user name or password (not shown): fix them "
                                  "in AFE_DATABASE_URL")
    if "does not exist" in low and "database" in low:
        return FailedPrecondition(f"{db} does not exist on its server: give the database the "
                                  "first machine uses")
    if "private key file" in low or "certificate file" in low or "root certificate file" in low:
        return ConfigError("the database client cannot read --ca, --tls-cert or --tls-key "
                           "(a key must be mode 0600 and yours); fix the file named by the flag")
    return Unavailable(f"cannot reach {db}: check that the server runs and accepts connections "
                       "from this machine, and the host and port in the URL")
