"""Stateless session cookies (R20, R21).

value = b64url(json {"v":1,"iat":..,"exp":..}) "." b64url(HMAC-SHA256(key, payload))
key   = HKDF-SHA256(token, salt="afe-session-v1", info="afe gateway session cookie")

Nothing is stored server-side: a cookie is valid while its MAC verifies under
the key of the CURRENT token and it has not expired. A new token means a new
key, so every cookie issued before stops verifying at once.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

COOKIE_NAME = "afe_session"
DEFAULT_TTL = 12 * 3600
_SALT = b"afe-session-v1"
_INFO = b"afe gateway session cookie"
_MAX_LEN = 512
_CLOCK_SKEW = 60


def derive_key(token: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=_INFO).derive(token.encode("utf-8"))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Session:
    issued_at: int
    expires_at: int

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at


def sign(key: bytes, *, now: float | None = None, ttl: int = DEFAULT_TTL) -> str:
    iat = int(time.time() if now is None else now)
    payload = json.dumps({"v": 1, "iat": iat, "exp": iat + ttl}, separators=(",", ":")).encode()
    mac = hmac.new(key, payload, hashlib.sha256).digest()
    return f"{_b64(payload)}.{_b64(mac)}"


def verify(key: bytes, value: str | None, *, now: float | None = None) -> Session | None:
    """The session a cookie value carries, or None if it is not valid now."""
    if not value or len(value) > _MAX_LEN or value.count(".") != 1:
        return None
    head, tail = value.split(".")
    try:
        payload = _unb64(head)
        mac = _unb64(tail)
    except (binascii.Error, ValueError):
        return None
    if not hmac.compare_digest(hmac.new(key, payload, hashlib.sha256).digest(), mac):
        return None
    try:
        doc = json.loads(payload)
        iat, exp = doc["iat"], doc["exp"]
    except (ValueError, KeyError, TypeError):
        return None
    if doc.get("v") != 1 or not isinstance(iat, int) or not isinstance(exp, int):
        return None
    t = time.time() if now is None else now
    if iat > t + _CLOCK_SKEW or exp <= t:
        return None
    return Session(iat, exp)


def set_cookie_header(value: str, *, secure: bool, max_age: int) -> str:
    """The exact Set-Cookie header (R21)."""
    parts = [f"{COOKIE_NAME}={value}", "HttpOnly", f"Max-Age={max_age}", "Path=/", "SameSite=Strict"]
    if secure:
        parts.append("Secure")
    return "; ".join(parts)


def clear_cookie_header(*, secure: bool) -> str:
    return set_cookie_header("", secure=secure, max_age=0)
