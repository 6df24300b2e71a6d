"""Runs inside SWE-ReX's own venv (bench/bench_swerex.py makes it), never
in afe's: SWE-ReX's real client, `DockerDeployment`, on a local image with
its server inside, nothing pulled. Prints one JSON document.

    <venv>/bin/python bench/swerex_driver.py IMAGE LABEL STARTS COMMANDS

- `start_session_s`: `DockerDeployment.start()` (docker run, wait until its
  server answers) + `create_session` + the first `run_in_session("echo hi")`
  answered: what SWE-agent does before its first command;
- `start_execute_s`: `start()` + the first `execute(["echo", "hi"])`, its
  cheapest path (no bash session);
- `session_s` / `execute_s`: per-command latency of `true` in a live
  deployment, both ways.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time


async def _deployment(image: str, label: str):
    from swerex.deployment.docker import DockerDeployment

    return DockerDeployment(image=image, pull="never", python_standalone_dir=None,
                            docker_args=["--label", label], startup_timeout=60.0)


async def start_sample(image: str, label: str, session: bool) -> float:
    from swerex.runtime.abstract import BashAction, Command, CreateBashSessionRequest

    d = await _deployment(image, label)
    t0 = time.perf_counter()
    try:
        await d.start()
        if session:
            await d.runtime.create_session(CreateBashSessionRequest())
            obs = await d.runtime.run_in_session(BashAction(command="echo hi"))
        else:
            obs = await d.runtime.execute(Command(command=["echo", "hi"]))
        dt = time.perf_counter() - t0
        text = obs.output if session else obs.stdout
        if text.strip() != "hi":
            raise RuntimeError(f"unexpected first output {obs!r}")
        return dt
    finally:
        await d.stop()


async def command_samples(image: str, label: str, n: int) -> tuple[list[float], list[float]]:
    from swerex.runtime.abstract import BashAction, Command, CreateBashSessionRequest

    d = await _deployment(image, label)
    try:
        await d.start()
        await d.runtime.create_session(CreateBashSessionRequest())
        session, execute = [], []
        for i in range(n + 3):          # interleaved; the first 3 of each are warm-up
            t0 = time.perf_counter()
            obs = await d.runtime.run_in_session(BashAction(command="true"))
            t1 = time.perf_counter()
            res = await d.runtime.execute(Command(command=["true"]))
            t2 = time.perf_counter()
            if obs.exit_code != 0 or res.exit_code != 0:
                raise RuntimeError(f"`true` failed: {obs!r} {res!r}")
            if i >= 3:
                session.append(t1 - t0)
                execute.append(t2 - t1)
        return session, execute
    finally:
        await d.stop()


async def main(image: str, label: str, starts: int, commands: int) -> dict:
    import swerex

    out: dict = {"version": getattr(swerex, "__version__", "unknown"),
                 "start_session_s": [], "start_execute_s": [], "session_s": [], "execute_s": []}
    for _ in range(starts):
        out["start_session_s"].append(await start_sample(image, label, True))
        out["start_execute_s"].append(await start_sample(image, label, False))
    if commands:
        out["session_s"], out["execute_s"] = await command_samples(image, label, commands)
    return out


if __name__ == "__main__":
    image, label, starts, commands = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    print(json.dumps(asyncio.run(main(image, label, starts, commands))))
