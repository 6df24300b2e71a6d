"""The event pipeline's fast paths give the same results as the plain ones.

The redactor skips regexes behind cheap checks, and the event log checks a
whole batch's JSON at once: each shortcut is compared here with the plain
computation it stands for (R27), on ordinary text and on text with secrets.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
import sqlite3

import pytest

from services.common.secrecy import redact as R
from services.common.secrecy.redact import MASK, Redactor, has_token_run
from services.scheduler.events.log import FINAL_EVENT, MAX_STRING, EventLog
from services.scheduler.store.store import Store

pytestmark = pytest.mark.timeout(60)

SECRETS = [
    "ghp_" + "a1B2" * 9,
    "gho_" + "Zz09" * 5,
    "github_pat_" + "x9Y8" * 8,
    "sk-" + "Q7w" * 8,
    "xoxb-1234567890-abcdefghij",
    "AKIAABCDEFGHIJKLMNOP",
    "ASIA0123456789ABCDEF",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "Bearer abcdefghijklmnop.qrstuv",
    "https://user:hunter2hunter2@example.invalid/repo.git",
    base64.b64encode(bytes(range(7, 37))).decode(),
    "a-registered-secret-value",
    base64.b64encode(b"a-registered-secret-value").decode(),
    # the shortest match of each pattern
    "ghp_" + "A" * 16, "github_pat_" + "A" * 20, "sk-" + "A" * 16, "xoxb-" + "A" * 10, "AKIA" + "A" * 16,
    "eyJ" + "A" * 8 + ".bbbbbbbb.cccccccc", "bearer " + "A" * 12,
]
WORDS = ["line", "ok", "test_something", "(12 ms)", "gh", "IA", "sk", "xo", "ey", "bearer", "://", "@",
         "é", "日本", "\x00", "\t", "\n", '"', "\\", "src/components/Button/index", "a" * 31, "Ab1" * 11]


def plain_redact(redactor: Redactor, text: str) -> str:
    """Redactor.redact without any of its shortcuts."""
    values = sorted(set(redactor._values), key=len, reverse=True)
    if values:
        text = re.compile("|".join(re.escape(v) for v in values)).sub(MASK, text)
    text = R._URL_USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)
    for _name, pat in R.SECRET_PATTERNS:
        text = pat.sub(MASK, text)
    return R._TOKENISH.sub(lambda m: MASK if R.looks_high_entropy(m.group(0)) else m.group(0), text)


def random_texts(n: int, seed: int = 5) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = [rng.choice(WORDS) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.5:
            parts.insert(rng.randint(0, len(parts)), rng.choice(SECRETS))
        out.append(rng.choice(["", " ", "\x00", "/"]).join(parts))
    return out


def test_r27_redactor_shortcuts_give_the_plain_result():
    r = Redactor(["a-registered-secret-value"])
    texts = random_texts(3000)
    changed = 0
    for text in texts:
        expected = plain_redact(r, text)
        changed += expected != text
        assert r.redact(text) == expected, text
    assert changed > 1000  # positive control: the samples do hold secrets the plain path removes


def test_r27_substring_scan_and_regex_paths_agree_for_many_registered_values():
    few = Redactor([f"registered-value-{i:03d}" for i in range(3)])
    many = Redactor([f"registered-value-{i:03d}" for i in range(40)])   # past the substring-scan limit
    assert len(many._compiled[0]) > R._SCAN_VALUES >= len(few._compiled[0])
    for r in (few, many):
        text = "x registered-value-002 y " + base64.b64encode(b"registered-value-001").decode()
        assert r.redact(text) == plain_redact(r, text) == f"x {MASK} y {MASK}"


def test_token_run_check_matches_the_regex():
    rng = random.Random(7)
    alphabet = R._TOKEN_CHARS + " .:\"\x00é日\ud800"
    for _ in range(3000):
        s = "".join(rng.choice(alphabet) if rng.random() < 0.2 else rng.choice("ab")
                    for _ in range(rng.randint(0, 80)))
        assert has_token_run(s) == (R._TOKENISH.search(s) is not None), s
    assert has_token_run("x" * 32) and not has_token_run("x" * 31 + "é" + "x" * 31)


def test_every_pattern_match_holds_its_shortest_token_run():
    jwt_tail = ".bbbbbbbb.cccccccc"
    shortest = {"GitHub token": ("ghp_", 16), "GitHub fine-grained token": ("github_pat_", 20),
                "API key (sk-)": ("sk-", 16), "Slack token": ("xoxb-", 10), "AWS access key": ("AKIA", 16),
                "JWT": ("eyJ", 8)}
    patterns = dict(R.SECRET_PATTERNS)
    assert set(shortest) == set(R._MIN_RUNS)
    for name, (prefix, n) in shortest.items():   # the claimed run is the shortest match's: tight
        tail = jwt_tail if name == "JWT" else ""
        text = prefix + "A" * n + tail
        assert patterns[name].fullmatch(text) and not patterns[name].search(prefix + "A" * (n - 1) + tail)
        assert has_token_run(text, R._MIN_RUNS[name]) and not has_token_run(text, R._MIN_RUNS[name] + 1)
    rng = random.Random(11)
    pieces = ["ghp_", "github_pat_", "sk-", "xoxb-", "AKIA", "eyJ", ".", "a", "Z", "9", "_", "-", " ", "é", "+"]
    hits = 0
    for _ in range(20000):
        s = "".join(rng.choice(pieces) if rng.random() < 0.3 else "aZ9"[rng.randrange(3)]
                    for _ in range(rng.randint(0, 60)))
        for name, run in R._MIN_RUNS.items():
            if patterns[name].search(s):
                hits += 1
                assert has_token_run(s, run), (name, s)
    assert hits > 1000   # positive control: the samples do match the patterns


def test_every_literal_holds_its_gate():
    for name, gate in R._GATES.items():
        assert all(gate in lit for lit in R._LITERALS[name]), name


# --- the event log ---------------------------------------------------------

TOKEN = "ghp_" + "a1B2c3D4e5F6g7H8i9J0"


def _log(tmp_path, *secrets: str) -> EventLog:
    return EventLog(Store.sqlite(tmp_path / "afe.db"), Redactor(secrets))


def _stored(log: EventLog, tid: str) -> list[object]:
    log.flush()
    return [json.loads(e.payload_json) for e in log.store.events.read(tid, 1)]


@pytest.mark.parametrize("text", [f"x\n{TOKEN}", f'say "{TOKEN}"', f"C:\\{TOKEN}", f"tab\t{TOKEN}\tend"])
def test_r27_secrets_next_to_escaped_characters_are_redacted(tmp_path, text):
    # Positive control: in JSON, the escape glues a word character to the
    # token ("\\n" + "ghp_..."), so a check of the JSON text alone misses it.
    if "\n" in text or "\t" in text:
        assert Redactor().redact(json.dumps({"t": text})) == json.dumps({"t": text})
    log = _log(tmp_path)
    log.append("t-1", "node.output", {"t": text})
    (stored,) = _stored(log, "t-1")
    assert TOKEN not in json.dumps(stored) and MASK in stored["t"]


def test_r27_a_dirty_batch_redacts_only_the_events_that_need_it(tmp_path):
    log = _log(tmp_path, "s3cr3t-Value-9f8e7d6c")
    payloads = [{"text": "clean line"}, {"s3cr3t-Value-9f8e7d6c": 1}, {"deep": [{"x": ("a", TOKEN)}]},
                {"n": 2 ** 70, "f": 1.5, "b": True, "none": None}, {1: "int key"}]
    for p in payloads:
        log.append("t-1", "x", p)
    assert _stored(log, "t-1") == [{"text": "clean line"}, {MASK: 1}, {"deep": [{"x": ["a", MASK]}]},
                                   {"n": 2 ** 70, "f": 1.5, "b": True, "none": None}, {"1": "int key"}]


def test_r27_events_made_outside_the_buffer_are_redacted(tmp_path):
    log = _log(tmp_path, "s3cr3t-Value-9f8e7d6c")
    ev = log.make("t-1", "ticket.created", {"title": "uses s3cr3t-Value-9f8e7d6c", "tab": f"\t{TOKEN}"})
    assert json.loads(ev.payload_json) == {"title": f"uses {MASK}", "tab": f"\t{MASK}"}
    assert ev.seq == 1 and log.append("t-1", "x", {}) == 2


def test_long_strings_are_cut_in_nested_payloads_and_keys_stay(tmp_path):
    log = _log(tmp_path)
    log.append("t-1", "x", {"outer": {"text": "y" * (MAX_STRING + 10)}, "short": "ok"})
    (stored,) = _stored(log, "t-1")
    assert stored["short"] == "ok" and stored["outer"]["text"].endswith("... [10 characters cut]")


def test_a_payload_that_is_not_json_fails_at_append_without_taking_a_seq(tmp_path):
    log = _log(tmp_path)
    assert log.append("t-1", "x", {"a": 1}) == 1
    with pytest.raises(TypeError):
        log.append("t-1", "x", {"obj": object()})
    assert log.append("t-1", "x", {"a": 2}) == 2
    assert _stored(log, "t-1") == [{"a": 1}, {"a": 2}]


def test_sqlite_batches_go_in_few_multi_row_inserts_and_store_every_event_exactly(tmp_path):
    """SQLite takes a batch as multi-row INSERTs of a power of two rows (within the driver's
    variable limit), so its thread lets go of the GIL per statement, not per row."""
    from services.scheduler.store.base import EventRecord

    store = Store.sqlite(tmp_path / "s.db")
    statements: list[str] = []
    with store.db.transaction() as conn:
        dbapi = conn.connection.driver_connection
        dbapi.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 22)    # 4 rows of 5 columns per statement
        dbapi.set_trace_callback(statements.append)
    texts = ["plain", "é 日本 \\ \" \t", "x" * 5000, "\x00 nul", "🙂"]
    batch = [EventRecord("t-1", i + 1, "node.output", json.dumps({"text": texts[i % 5], "i": i}), 1000 + i)
             for i in range(11)]
    store.events.append(batch)
    inserts = [s for s in statements if s.startswith("INSERT INTO events ")]
    assert [s.count("),(") + 1 for s in inserts] == [4, 4, 2, 1]     # 11 = 4 + 4 + 2 + 1
    store.events.append([tuple(EventRecord("t-1", 12 + i, "x", "{}", 5)) for i in range(3)])
    assert list(store.events.read("t-1", 1)) == batch + [EventRecord("t-1", 12 + i, "x", "{}", 5) for i in range(3)]
    assert store.events.last_seq("t-1") == 14
    store.close()


async def _watch(log: EventLog, tid: str) -> list[tuple[int, str]]:
    return [(e.seq, e.type) async for e in log.watch(tid, 1, True, lambda: False)]


async def test_batched_delivery_splits_tickets_keeps_order_and_stops_at_the_final_event(tmp_path):
    log = _log(tmp_path)
    a = asyncio.create_task(_watch(log, "t-a"))
    b = asyncio.create_task(_watch(log, "t-b"))
    await asyncio.sleep(0)
    for i in range(10):   # one batch: both tickets interleaved, then the final events
        log.append("t-a", "x", {"i": i})
        log.append("t-b", "x", {"i": i})
    log.append("t-a", FINAL_EVENT, {})
    log.append("t-a", "after", {})     # stored, but the watch ends at the final event
    log.append("t-b", FINAL_EVENT, {})
    log.flush()
    assert await asyncio.wait_for(a, 10) == [(i, "x") for i in range(1, 11)] + [(11, FINAL_EVENT)]
    assert await asyncio.wait_for(b, 10) == [(i, "x") for i in range(1, 11)] + [(11, FINAL_EVENT)]
    assert len(_stored(log, "t-a")) == 12


async def test_a_watcher_skips_what_it_has_and_fills_a_gap_from_the_store(tmp_path):
    log = _log(tmp_path)
    log.append("t-1", "x", {})
    w = asyncio.create_task(_watch(log, "t-1"))
    await asyncio.sleep(0.05)          # history (seq 1) sent; now live
    log.append("t-1", "x", {})
    log.append("t-1", "x", {})
    log.flush()
    records = log.store.events.read("t-1", 1)
    log.delivered(records[:2])         # a duplicate of what was sent: skipped
    log.append("t-1", "x", {})
    log.flush()                        # seq 4 stored (the store takes a ticket's seqs only in order)
    log.store.events.append([records[0]._replace(seq=5, type="stored-elsewhere")])  # written by the store, not delivered
    log._seq["t-1"] = 5
    log.append("t-1", FINAL_EVENT, {})
    log.flush()
    assert await asyncio.wait_for(w, 10) == [(1, "x"), (2, "x"), (3, "x"), (4, "x"), (5, "stored-elsewhere"),
                                             (6, FINAL_EVENT)]
