"""`afe certs DIR --name NAME[=HOST,...] ...`: the deployment's own CA and
the certificates of the links between hosts (R39, docs/SCALE.md).

    afe certs /etc/afe/pki --name scheduler --name sandbox-1=sb1.internal,10.0.0.11

makes, in DIR (mode 0700, every file 0600):
- `ca.pem`, `ca.key`: the CA, made on the first run and reused after
  (EC P-256, 10 years); keep `ca.key` off the hosts that run afe;
- per name, `NAME.pem` and `NAME.key`: a leaf certificate (EC P-256, `--days`,
  default 397) for client and server use, common name NAME, with the HOSTs
  as subject alternative names (DNS names or IP addresses; NAME alone when
  none are given);
- per name, `NAME.secret`: the link secret callers of NAME present with
  each call (64 hex digits), the second factor next to the certificate.

Copy NAME.pem, NAME.key, NAME.secret and ca.pem to the host that runs NAME.
An existing leaf is kept unless `--force` (re-issue it).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.rpc.links import new_secret

if TYPE_CHECKING:   # cryptography is imported when certificates are made, not at CLI start
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey

EXIT_OK = 0
EXIT_FAILED = 1

CA_DAYS = 3650
LEAF_DAYS = 397


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("certs", help="make the deployment CA and link certificates (mutual TLS between hosts)",
                       description="Make the deployment's own CA (once) and, per --name, a certificate, key "
                       "and link secret for a process on another host (R39). Files are mode 0600.")
    p.add_argument("dir", help="folder for the CA and the certificates (made 0700)")
    p.add_argument("--name", action="append", default=[], metavar="NAME[=HOST,...]",
                   help="a process that gets a certificate (e.g. scheduler, sandbox-1=sb1.internal,10.0.0.11): "
                   "HOSTs are the DNS names or IP addresses its peers dial; repeatable")
    p.add_argument("--days", type=int, default=LEAF_DAYS, help=f"leaf validity in days (default {LEAF_DAYS})")
    p.add_argument("--force", action="store_true", help="re-issue leaves that exist already")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        made = make_certs(Path(args.dir), [parse_name(n) for n in args.name], days=args.days, force=args.force)
    except ValueError as exc:
        print(f"afe certs: {exc}", file=sys.stderr)
        return EXIT_FAILED
    for line in made:
        print(line)
    return EXIT_OK


def parse_name(value: str) -> tuple[str, list[str]]:
    name, _, hosts = value.partition("=")
    name = name.strip()
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise ValueError(f"--name {value!r}: a name is letters, digits, '-', '_' or '.' (e.g. sandbox-1)")
    if name == "ca":
        raise ValueError("--name ca: that name is the CA's own files; choose another")
    return name, [h.strip() for h in hosts.split(",") if h.strip()]


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to a new file of mode 0600 (replacing an old one atomically)."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _key_pem(key: EllipticCurvePrivateKey) -> bytes:
    """The private key as unencrypted PKCS#8 PEM (the file itself is 0600)."""
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_certs(folder: Path, names: list[tuple[str, list[str]]], *, days: int = LEAF_DAYS,
               force: bool = False) -> list[str]:
    """Make (or reuse) the CA in `folder` and a leaf per name; return one line per file made."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if days < 1:
        raise ValueError("--days must be at least 1")
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    made: list[str] = []
    now = datetime.datetime.now(datetime.UTC)
    pem = serialization.Encoding.PEM

    ca_pem, ca_key_path = folder / "ca.pem", folder / "ca.key"
    if ca_pem.exists() and ca_key_path.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_pem.read_bytes())
        ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{ca_key_path} is not an EC key made by `afe certs`; move it away to make a new CA")
    elif ca_pem.exists() or ca_key_path.exists():
        raise ValueError(f"{folder} holds only one of ca.pem and ca.key; restore the other or remove both")
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"afe deployment CA {now:%Y-%m-%d}")])
        ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
                   .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                                key_encipherment=False, data_encipherment=False,
                                                key_agreement=False, key_cert_sign=True, crl_sign=True,
                                                encipher_only=False, decipher_only=False), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
                   .sign(ca_key, hashes.SHA256()))
        _write_private(ca_key_path, _key_pem(ca_key))
        _write_private(ca_pem, ca_cert.public_bytes(pem))
        made.append(f"made the CA {ca_pem} (keep {ca_key_path} off the hosts that run afe)")

    for name, hosts in names:
        cert_path, key_path, secret_path = folder / f"{name}.pem", folder / f"{name}.key", folder / f"{name}.secret"
        if cert_path.exists() and not force:
            made.append(f"kept {cert_path} (exists; --force re-issues it)")
            continue
        sans: list[x509.GeneralName] = []
        for h in hosts or [name]:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=True, key_cert_sign=False, crl_sign=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write_private(key_path, _key_pem(key))
        _write_private(cert_path, cert.public_bytes(pem))
        if force or not secret_path.exists():
            _write_private(secret_path, new_secret().hex().encode() + b"\n")
        made.append(f"made {cert_path}, {key_path} and {secret_path} for {', '.join(hosts or [name])}")
    return made
