"""The judge of issue 32's "Done when" (tests/system/test_r37_r45_failover.py):
every property an observation of tests/system/failover_scenario.py breaks,
each as "key: what, where" (key: livez, readyz-503, readyz-200, scenario,
state, seq, lines, stale, lost, self-fence, forge). Plain Python over the
observation's JSON, so the same judge reads a run of today's code and one
of the code before issue 32 (the positive control), and fast tests feed it
made-up observations (tests/system/test_failover_judge.py).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^([0-9a-f]{8}) line-(\d+)$")
NODE = "edit"
# Events the new attempt writes about an older one (its lost output, why it runs again).
ABOUT_AN_ATTEMPT = {"events.lost", "node.attempt"}
LIVEZ_S = 1.0        # a prober's time-out
READYZ_S = 2.0       # the bound for /readyz to say the store is away


# -- the judge: what an observation breaks, each as "key: what and where" ---------------------


def _probes(obs: dict) -> list[str]:
    t = obs["t"]
    out = []
    paused = obs.get("paused") or {}
    for name, p in obs["probes"].items():
        # The test paused this one (SIGSTOP): its silence then is the test's doing, not a freeze.
        quiet = (paused.get("from", 0) - LIVEZ_S, paused.get("to", 0)) if paused.get("scheduler") == name else (0, 0)
        during = [(at, st, took) for at, st, took in p["livez"] if t["stop"] <= at <= t["up"] + 5
                  and not quiet[0] <= at <= quiet[1]]
        slow = [(round(at - t["stop"], 1), st, round(took, 2)) for at, st, took in during
                if st != 200 or took >= LIVEZ_S]
        if not during or slow:
            out.append(f"livez: {name}'s /livez did not answer 200 within {LIVEZ_S:g} s during the outage "
                       f"(s after the stop, status, seconds): {slow[:10]} of {len(during)} probes")
        not_ready = [at for at, st, failing in p["readyz"] if at >= t["stop"] and st == 503 and "store" in failing]
        first = min(not_ready) - t["stop"] if not_ready else None
        if first is None or first > READYZ_S:
            seen = sorted({(st, tuple(f)) for at, st, f in p["readyz"] if t["stop"] <= at <= t["up"]})
            out.append(f"readyz-503: {name}'s /readyz did not answer 503 naming the store within {READYZ_S:g} s "
                       f"of the stop (first after {first} s; answers during the outage: {seen})")
        if not any(at > t["up"] and st == 200 for at, st, _f in p["readyz"]):
            out.append(f"readyz-200: {name}'s /readyz never answered 200 after the database was back")
    return out


def _attempt_of(events: list[dict]) -> dict[int, int]:
    """seq -> the attempt of NODE an event belongs to: its own `attempt` when it says, else
    the latest `node.started` of NODE before it."""
    current, out = 0, {}
    for e in events:
        p = e["payload"]
        if p.get("node") != NODE:
            continue
        if e["type"] == "node.started":
            current = int(p.get("attempt", current + 1))
        out[e["seq"]] = int(p["attempt"]) if isinstance(p.get("attempt"), int) else current
    return out


def _lines(e: dict) -> list[tuple[str, int] | str]:
    got: list[tuple[str, int] | str] = []
    for raw in e["payload"].get("text", "").splitlines():
        m = LINE.match(raw)
        got.append((m.group(1), int(m.group(2))) if m else raw)
    return got


def _ticket(name: str, tk: dict, obs: dict) -> list[str]:
    out: list[str] = []
    ev = tk["events"]
    where = f"{name} ({tk['id']})"
    if tk["state"] != "succeeded":
        out.append(f"state: {where} ended {tk['state']}: {tk['error'][:300]}")
    seqs = [e["seq"] for e in ev]
    if seqs != list(range(1, len(seqs) + 1)):
        out.append(f"seq: {where}'s seqs are not 1..{len(seqs)} without gaps")

    attempt = _attempt_of(ev)
    started = {}            # attempt -> seq of its node.started
    for e in ev:
        if e["type"] == "node.started" and e["payload"].get("node") == NODE:
            started[attempt[e["seq"]]] = e["seq"]
    by_attempt: dict[int, list[tuple[int, str, int]]] = defaultdict(list)   # attempt -> (seq, run, line)
    first_seen: dict[str, int] = {}                                          # run -> first seq
    for e in ev:
        if e["type"] != "node.output" or e["payload"].get("node") != NODE:
            continue
        for line in _lines(e):
            if isinstance(line, str):
                out.append(f"lines: {where} seq {e['seq']} holds a line no run printed: {line[:80]!r}")
                continue
            run, n = line
            first_seen.setdefault(run, e["seq"])
            by_attempt[attempt[e["seq"]]].append((e["seq"], run, n))

    finished = [attempt[e["seq"]] for e in ev if e["type"] == "node.finished"
                and e["payload"].get("node") == NODE and e["payload"].get("state") == "succeeded"]
    if len(finished) != 1:
        out.append(f"lines: {where}: {NODE} finished (succeeded) {len(finished)} times, attempts {finished}")
    for a, lines in sorted(by_attempt.items()):
        runs = sorted({run for _s, run, _n in lines})
        if len(runs) != 1:
            out.append(f"stale: {where} attempt {a} holds the lines of {len(runs)} runs {runs}: another "
                       f"attempt's output was stored as this one's (first seqs {[first_seen[r] for r in runs]})")
        for run in runs:
            nums = [n for _s, r, n in lines if r == run]
            if nums != list(range(1, len(nums) + 1)):
                dup = sorted({n for n in nums if nums.count(n) > 1})
                out.append(f"lines: {where} attempt {a} run {run}: lines not once each in order: "
                           f"{len(nums)} lines, repeated {dup[:10]}, starts {nums[:5]}")
        if finished and a == finished[-1] and len({n for _s, _r, n in lines}) != obs["lines"]:
            out.append(f"lines: {where} attempt {a} finished with {len({n for _s, _r, n in lines})} of "
                       f"{obs['lines']} lines stored")

    # Nothing of an older attempt after a newer one started, nor after a takeover.
    takeovers = [e["seq"] for e in ev if e["type"] == "ticket.takeover"]
    for a, s in sorted(started.items()):
        older = {run for b, lines in by_attempt.items() if b < a for _s, run, _n in lines}
        late = [(seq, run) for b, lines in by_attempt.items() for seq, run, _n in lines if seq > s and run in older]
        late += [(e["seq"], e["type"]) for e in ev if e["seq"] > s and e["payload"].get("node") == NODE
                 and e["type"] not in ABOUT_AN_ATTEMPT
                 and isinstance(e["payload"].get("attempt"), int) and e["payload"]["attempt"] < a]
        if late:
            out.append(f"stale: {where}: {len(late)} events of an attempt before {a} stored after attempt {a} "
                       f"started (seq {s}), first {sorted(late)[:5]}")
    for e in ev:     # events that name their scheduler: none of the old owner's after the takeover
        if e["type"] != "ticket.takeover":
            continue
        new = e["payload"].get("scheduler")
        other = [(x["seq"], x["type"], x["payload"]["scheduler"]) for x in ev if x["seq"] > e["seq"]
                 and x["payload"].get("scheduler") not in (None, new)]
        if other:
            out.append(f"stale: {where}: events of another scheduler after {new}'s ticket.takeover (seq {e['seq']}): "
                       f"{other[:5]}")
    for s in takeovers:
        before = {run for lines in by_attempt.values() for seq, run, _n in lines if seq < s}
        late = sorted({seq for lines in by_attempt.values() for seq, run, _n in lines if seq > s and run in before})
        if late:
            out.append(f"stale: {where}: {len(late)} output events of the run before ticket.takeover (seq {s}) "
                       f"stored after it: seqs {late[:5]}..")

    # The lost attempt's output is counted. A 60 s outage outlives every lease: the run that
    # streamed through it cannot have gone on as if nothing happened.
    lost = [e for e in ev if e["type"] == "events.lost"]
    interrupted = [a for a in sorted(started) if a not in finished and a in by_attempt
                   and len(by_attempt[a]) < obs["lines"]]
    # An attempt that ended before the database stopped (its owner fenced itself on a loaded
    # machine, and the next attempt began before the stop) did not stream through the outage:
    # what it read was stored, so there may be nothing for an events.lost to count.
    stop_ms = obs.get("stop_wall_ms")
    begun = {a: next(e["at_ms"] for e in ev if e["seq"] == s) for a, s in started.items()}
    interrupted = [a for a in interrupted if not (stop_ms and begun.get(a + 1, stop_ms) < stop_ms)]
    for a in interrupted:
        counted = [e for e in lost if e["payload"].get("attempt", a) == a
                   and isinstance(e["payload"].get("count"), int) and e["payload"]["count"] >= 1]
        if not counted:
            out.append(f"lost: {where}: attempt {a} of {NODE} ended after {len(by_attempt[a])} stored lines and no "
                       f"events.lost counts what it printed after them ({[e['payload'] for e in lost]})")
    if name == "stream":
        at_stop = obs.get("stream_line_at_stop", 0)
        if not 0 < at_stop < obs["lines"]:
            out.append(f"scenario: {where} was not streaming when the database stopped (line {at_stop})")
        elif len(started) < 2:
            out.append(f"self-fence: {where}: {NODE} streamed through the {obs['outage_s']:g} s outage as attempt "
                       f"{sorted(started)} and was never stopped: its owner acted without a lease "
                       f"({obs['lease_s']:g} s) for the whole outage")

    # One branch, one pull request, each commit once.
    forge = tk["forge"]
    if len(forge["refs"]) != 1:
        out.append(f"forge: {where} has {len(forge['refs'])} branches: {forge['refs']}")
    if len(tk["prs"]) != 1:
        out.append(f"forge: {where} has {len(tk['prs'])} pull requests")
    elif forge.get("tip") and tk["prs"][0].get("head_sha") not in (None, forge["tip"]):
        out.append(f"forge: {where}'s pull request head {tk['prs'][0].get('head_sha')} is not its branch's tip")
    commits = forge["commits"]
    ids = [c["patch_id"] for c in commits]
    if len(commits) != 1 or len(set(ids)) != len(ids):
        out.append(f"forge: {where}'s branch holds {len(commits)} commits above the base (one node commits, "
                   f"once): {[(c['subject'], c['files'], c['notes_added']) for c in commits]}")
    if len(forge.get("notes_added", [])) != 1:
        out.append(f"forge: {where}'s pull request adds {forge.get('notes_added')} to NOTES.md: the re-run "
                   f"did not start from the last completed node's state")
    return out


def violations(obs: dict) -> list[str]:
    """Every property of the "Done when" the observation breaks; [] when it holds."""
    out = _probes(obs)
    if obs.get("paused") and not obs["paused"].get("taken_over"):
        out.append(f"scenario: {obs['paused']['scheduler']} was paused but nobody took its ticket over")
    if not obs.get("push_alive_at_down"):
        out.append("scenario: the push ended before the database was down (it was not in flight)")
    for name, tk in obs["tickets"].items():
        out += _ticket(name, tk, obs)
    return out


def judge(obs: dict, save: Path) -> list[str]:
    save.write_text(json.dumps(obs))
    problems = violations(obs)
    t = obs["t"]
    print(f"\n{obs['mode']}: push held {t['push_held'] - t['created']:.1f} s after the tickets were created, "
          f"stream at line {obs.get('stream_line_at_stop')}, database down {t['down'] - t['stop']:.2f} s after "
          f"the stop began, up {t['up'] - t['stop']:.1f} s after, tickets done {t['done'] - t['up']:.1f} s later; "
          f"owners before {obs.get('owners_before')} after {obs.get('owners_after')}; observation in {save}")
    for p in problems:
        print("  " + p)
    return problems
