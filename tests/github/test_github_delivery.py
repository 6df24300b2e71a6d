"""A webhook body is decoded once, leniently (services/scheduler/github/delivery.py):
every string of the document encodes as UTF-8 afterwards, whatever escapes
the sender used. Fast, no processes."""

from __future__ import annotations

import json

import pytest

from services.scheduler.github.delivery import decode_payload

ODD = (b'{"title\\ud800": ["x\\udc00y", {"body": "\\ud83d\\ude00 \\udc00\\ud800", "n": 1}], '
       b'"bytes": "caf\xc3\xa9 \xff"}')


def test_lone_surrogates_and_bad_bytes_become_replacement_characters():
    doc = decode_payload(ODD)
    assert doc == {"title\ufffd": ["x\ufffdy", {"body": "\U0001f600 \ufffd\ufffd", "n": 1}],
                   "bytes": "caf\u00e9 \ufffd"}
    json.dumps(doc, ensure_ascii=False).encode("utf-8")      # encodes: nothing is left to break later


def test_positive_control_plain_json_loads_keeps_a_lone_surrogate_that_does_not_encode():
    doc = json.loads(ODD.replace(b"\xff", b""))
    with pytest.raises(UnicodeEncodeError):
        json.dumps(doc, ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("payload", [b"", b"[]", b'"text"', b"{", b"[" * 200_000, b"\xff\xfe{}"])
def test_what_is_not_a_json_object_is_none(payload):
    assert decode_payload(payload) is None


def test_a_deeply_nested_object_is_cleaned_throughout():
    depth = 500
    payload = ('{"a":' * depth + '"\\ud800"' + "}" * depth).encode()
    doc = decode_payload(payload)
    for _ in range(depth - 1):
        doc = doc["a"]
    assert doc == {"a": "\ufffd"}


def test_utf8_with_a_byte_order_mark_is_still_json():
    assert decode_payload(b"\xef\xbb\xbf" + b'{"a": "b"}') == {"a": "b"}
