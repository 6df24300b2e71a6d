"""`make bench`: run every benchmark of the project and write the report.

Imports each `bench/bench_*.py`, calls its `run(out_dir) -> list[Result]`
(a module that fails is reported and the others still run), then writes
`bench/out/REPORT.md` — a table of every figure as a ratio against its
same-run baseline, with the target beside it — plus `bench/out/ratios.png`
and the machine it ran on. A module may also return `Section`s: markdown
(and charts it wrote into the report folder) printed after the table; a
Section's problems fail the module while its figures stay in the report.

    python -m bench.run                      # everything
    python -m bench.run --only sandbox       # bench/bench_sandbox.py only
    python -m bench.run --modules pkg.bench_x --out /tmp/report
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Result, Section

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "out"


@dataclass
class Outcome:
    module: str
    results: list[Result] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


def discover(bench_dir: Path = BENCH_DIR) -> list[str]:
    return sorted(f"bench.{p.stem}" for p in bench_dir.glob("bench_*.py"))


def short_name(module: str) -> str:
    return module.rsplit(".", 1)[-1].removeprefix("bench_")


def select(modules: list[str], only: list[str] | None) -> list[str]:
    if not only:
        return modules
    wanted = {o.removeprefix("bench_") for o in only}
    chosen = [m for m in modules if short_name(m) in wanted]
    unknown = wanted - {short_name(m) for m in chosen}
    if unknown:
        raise SystemExit(f"--only: no benchmark named {', '.join(sorted(unknown))}; "
                         f"choose from {', '.join(short_name(m) for m in modules)}")
    return chosen


def run_module(module: str, out_dir: Path) -> Outcome:
    t0 = time.perf_counter()
    outcome = Outcome(module)
    try:
        mod = importlib.import_module(module)
        results = mod.run(out_dir)
        bad = [r for r in results if not isinstance(r, (Result, Section))]
        if bad:
            raise TypeError(f"run() must return bench.common.Result or Section objects, "
                            f"got {type(bad[0]).__name__}")
        outcome.results = [r for r in results if isinstance(r, Result)]
        outcome.sections = [r for r in results if isinstance(r, Section)]
        problems = [p for s in outcome.sections for p in s.problems]
        if problems:
            outcome.error = "checks failed:\n" + "\n".join(f"- {p}" for p in problems)
    except BaseException as exc:  # one broken benchmark must not stop the others
        if isinstance(exc, KeyboardInterrupt):
            raise
        outcome.error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        outcome.error += "\n" + "".join(traceback.format_tb(exc.__traceback__)[-3:])
    outcome.seconds = time.perf_counter() - t0
    return outcome


def _cmd(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
        return out.stdout.strip() or "unavailable"
    except (OSError, subprocess.SubprocessError):
        return "unavailable"


def machine() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    except (OSError, ValueError):
        pass
    return {
        "CPU": cpu,
        "cores": str(os.cpu_count()),
        "memory": mem,
        "kernel": f"{platform.system()} {platform.release()}",
        "Docker": _cmd(["docker", "version", "--format", "{{.Server.Version}}"]),
        "Python": f"{platform.python_implementation()} {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _fmt_s(value: float) -> str:
    if value == 0 or not math.isfinite(value):
        return str(value)
    if value < 1e-3:
        return f"{value * 1e6:.1f} µs"
    if value < 1:
        return f"{value * 1e3:.2f} ms"
    return f"{value:.2f} s"


def _fmt_rate(value: float) -> str:
    """Throughput-style figures (higher is better) are counts per second, not times."""
    return f"{value:,.0f}/s" if abs(value) >= 1000 else f"{value:.4g}/s"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_report(outcomes: list[Outcome], out_dir: Path, info: dict[str, str]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = [r for o in outcomes for r in o.results]
    chart = write_chart(results, out_dir / "ratios.png")
    targeted = [r for r in results if r.target is not None]
    met = sum(r.met for r in targeted)
    lines = ["# afe benchmark report", "",
             (f"{len(results)} measurements from {len(outcomes)} modules; {met} of the {len(targeted)} "
              f"with a target meet it (the others are reported beside them); "
              f"{sum(o.error is not None for o in outcomes)} modules failed."), "",
             ("Each figure is a ratio against a baseline measured in the same run on the same machine "
              "(lower is better unless the target says ≥)."), "",
             "| issue | measurement | baseline | our figure | baseline figure | ratio | target | met? |",
             "|---:|---|---|---:|---:|---:|---:|:---:|"]
    for r in sorted(results, key=lambda r: (r.issue, r.name)):
        if r.target is None:
            target, met_cell = "—", "—"
        else:
            target = f"≥ {r.target:g}" if r.higher_is_better else f"≤ {r.target:g}"
            met_cell = "yes" if r.met else "**no**"
        fmt = _fmt_rate if r.higher_is_better else _fmt_s
        lines.append(f"| {r.issue} | {_md(r.name)} | {_md(r.baseline)} | {fmt(r.measured_s)} | "
                     f"{fmt(r.baseline_s)} | {r.ratio:.3g} | {target} | {met_cell} |")
    for o in outcomes:
        for s in o.sections:
            lines += ["", f"## {s.title}", "", s.body.rstrip()]
            if s.problems:
                lines += ["", "**Checks failed:**", ""] + [f"- {_md(p)}" for p in s.problems]
            lines += [""] + [f"![{_md(s.title)}]({img})" for img in s.images]
    notes = [r for r in results if r.notes]
    if notes:
        lines += ["", "## Notes", ""] + [f"- **{_md(r.name)}**: {_md(r.notes)}" for r in notes]
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        lines += ["", "## Failed benchmark modules", ""]
        for o in failed:
            lines += [f"### `{o.module}`", "", "```", (o.error or "").strip(), "```", ""]
    lines += ["", "## Modules", "", "| module | results | time | status |", "|---|---:|---:|---|"]
    for o in outcomes:
        lines.append(f"| `{o.module}` | {len(o.results)} | {o.seconds:.1f} s | "
                     f"{'failed' if o.error else 'ok'} |")
    lines += ["", "## Machine", ""] + [f"- **{k}**: {_md(v)}" for k, v in info.items()]
    if chart is not None:
        lines += ["", "## Chart", "", f"![ratios]({chart.name})"]
    report = out_dir / "REPORT.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def write_chart(results: list[Result], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if math.isfinite(r.ratio) and r.ratio > 0]
    fig, ax = plt.subplots(figsize=(10, max(2.5, 0.45 * len(rows) + 1.2)))
    if not rows:
        ax.text(0.5, 0.5, "no measurements", ha="center", va="center")
        ax.set_axis_off()
    else:
        labels = [f"#{r.issue} {r.name}"[:60] for r in rows]
        ys = list(range(len(rows)))
        ax.barh(ys, [r.ratio for r in rows], color=["#9e9e9e" if r.target is None else "#2e7d32" if r.met
                                                    else "#c62828" for r in rows])
        marked = [(r.target, y) for r, y in zip(rows, ys, strict=True) if r.target is not None]
        ax.scatter([t for t, _ in marked], [y for _, y in marked], marker="|", s=300, color="black", zorder=3)
        ax.set_yticks(ys, labels)
        ax.invert_yaxis()
        ratios = [r.ratio for r in rows] + [r.target for r in rows if r.target is not None]
        if max(ratios) / min(ratios) > 50:
            ax.set_xscale("log")
        ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("ratio to same-run baseline (bar green: target met, red: missed, grey: no target of its own; black tick: target)")
    ax.set_title("afe benchmarks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", metavar="NAME",
                   help="run only bench_NAME (repeatable)")
    p.add_argument("--modules", nargs="+", metavar="MODULE",
                   help="import these modules instead of discovering bench/bench_*.py")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report folder (default bench/out)")
    args = p.parse_args(argv)
    modules = select(args.modules or discover(), args.only)
    args.out.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for module in modules:
        print(f"bench: {module} ...", file=sys.stderr, flush=True)
        outcome = run_module(module, args.out)
        status = f"failed: {outcome.error.splitlines()[0]}" if outcome.error else f"{len(outcome.results)} results"
        print(f"bench: {module} {status} ({outcome.seconds:.1f} s)", file=sys.stderr, flush=True)
        outcomes.append(outcome)
    report = write_report(outcomes, args.out, machine())
    print(f"bench: report in {report}")
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
