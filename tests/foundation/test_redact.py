"""The redactor and the secret-shape detector shared by every process (R27, R30)."""

from __future__ import annotations

import base64
import secrets

import pytest

from services.common.secrecy.redact import MASK, Redactor, looks_high_entropy, secret_kind


@pytest.mark.parametrize("value", [
    "ghp_" + "a1B2" * 9,
    "github_pat_" + "x9Y8" * 8,
    "sk-" + "Q7w" * 8,
    "xoxb-1234567890-abcdefghij",
    "AKIAABCDEFGHIJKLMNOP",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "https://user:hunter2hunter2@example.invalid/repo.git",
    base64.b64encode(bytes(range(7, 37))).decode(),
])
def test_r27_secret_shapes_are_detected_and_redacted(value):
    assert secret_kind(value) is not None
    out = Redactor().redact(f"before {value} after")
    assert value not in out and MASK in out


def test_r30_registered_values_and_their_encodings_are_redacted():
    r = Redactor()
    plain = "Sup3r secret value/with+chars"
    assert Redactor().redact(plain) == plain  # positive control: unknown to a fresh redactor
    r.register(plain)
    for form in (plain, base64.b64encode(plain.encode()).decode(), "Sup3r%20secret%20value%2Fwith%2Bchars"):
        assert form not in r.redact(f"x {form} y")


@pytest.mark.parametrize("path", [
    "src/components/ShoppingCartCheckoutButton/index",
    "services/scheduler/engine/core/node_runner_helpers",
    "tests/acp/agents/flooding-agent-output",
])
def test_word_paths_are_not_mistaken_for_tokens(path):
    assert not looks_high_entropy(path)
    assert secret_kind(f"cat {path}") is None
    assert Redactor().redact(path) == path


def test_random_tokens_with_slashes_still_count_as_secrets():
    misses = 0
    for _ in range(2000):
        tok = base64.b64encode(secrets.token_bytes(30)).decode()
        misses += not looks_high_entropy(tok)
    assert misses <= 2  # a random 40-char base64 token is all but always caught
    assert looks_high_entropy("aB3dE5fG7hI9jK1lM3nO5pQ7rS9tU1vW/xY3zA5bC7dE9")
