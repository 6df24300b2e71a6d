"""Mutual TLS for links between hosts (R39).

A link that leaves the host (the scheduler calling a sandbox broker on
another machine) is a TCP connection with mutual TLS: each end presents a
certificate of the deployment's own CA (`afe certs`, services/cli/certs.py,
or the operator's) and trusts no other root. The server requires a client
certificate (`require_client_auth`); the client checks the server's
certificate against the same CA and the host name it dialled. The link
secret (links.py) still travels in each call's metadata: a second factor,
so a stolen certificate alone does not call a broker.

`TlsFiles` names the three PEM files; `server_credentials` and
`channel_credentials` read them once. A missing, unreadable or malformed
file is a `ConfigError` that says which flag or file to fix.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common import errors

# Private keys and link secrets must not be readable by anyone else.
_PRIVATE_MODE_MASK = 0o077


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of one end of a mutual-TLS link: its certificate, its
    private key (mode 0600) and the deployment CA's certificate."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, ca: str | None, what: str) -> TlsFiles | None:
        """None when no flag is given; all three or a ConfigError naming the missing ones."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            return None
        missing = [flag for flag, v in given.items() if not v]
        if missing:
            raise errors.ConfigError(f"{what} needs {', '.join(missing)} as well: mutual TLS takes a "
                                     "certificate, its key and the deployment CA (make them with `afe certs`)")
        return cls(Path(str(cert)), Path(str(key)), Path(str(ca)))

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA certificate) as PEM bytes."""
        return (_read_pem(self.cert, "certificate", private=False),
                _read_pem(self.key, "private key", private=True),
                _read_pem(self.ca, "CA certificate", private=False))


def _read_file(path: Path, what: str, *, private: bool, limit: int = 1024 * 1024) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise errors.ConfigError(f"cannot read {what} {path}: {exc.strerror}; "
                                 "make it with `afe certs` or correct the path") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if private and st.st_mode & _PRIVATE_MODE_MASK:
            raise errors.ConfigError(f"{what} {path} is readable by other users "
                                     f"(mode {stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}`")
        return f.read(limit)


def _read_pem(path: Path, what: str, *, private: bool) -> bytes:
    data = _read_file(path, f"the TLS {what}", private=private)
    if b"-----BEGIN " not in data:
        raise errors.ConfigError(f"the TLS {what} {path} is not a PEM file; make it with `afe certs`")
    return data


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """A server that serves only clients with a certificate of the CA in `files.ca`."""
    cert, key, ca = files.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """A client that presents its certificate and trusts only the CA in `files.ca`."""
    cert, key, ca = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def read_secret_file(path: str | Path, what: str) -> bytes:
    """A link secret kept in a file (a remote broker's: `afe certs` writes `<name>.secret`, 0600):
    64 hex digits."""
    raw = _read_file(Path(path), what, private=True, limit=4096)
    try:
        secret = bytes.fromhex(raw.strip().decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        secret = b""
    if len(secret) < 16:
        raise errors.ConfigError(f"{what} {path} does not hold a link secret (hex digits); "
                                 "make it with `afe certs`")
    return secret
