"""The credential broker's model relay (services/credentials/relay/server.py::RelayHub)
in a process of its own, with a low descriptor limit, for the tests that
flood one ticket's relay and watch another ticket's (R32).

    python -m tests.support.relayprocess ROOT UPSTREAM_URL KEY NOFILE on|off

Serves Model `claude` (anthropic, at UPSTREAM_URL, key KEY). On stdin, one
command a line: `open TICKET` (OpenRelay: answers {"capability": ...} or
{"error": ...}), `fds` ({"fds": open descriptors}); one JSON line answers
each on stdout. `off` builds the hub with every per-ticket limit turned off
(`RelayLimits.off()`, the tests' positive control); `on` with small limits.
Logs go to stderr as the broker's would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import sys
from pathlib import Path

from services.common.config.model import Config, Model
from services.common.layout import Layout
from services.common.secrecy.env_secrets import SecretValue
from services.common.secrecy.redact import Redactor
from services.credentials.relay.server import RelayHub, RelayLimits

LIMITS_ON = RelayLimits(connections=16, idle_s=30.0, head_s=5.0, body_s=30.0, buffered=1024 * 1024)


async def main(root: Path, url: str, key: str, limits: RelayLimits) -> None:
    layout = Layout(root / "data", root / "run")
    layout.ensure()
    config = Config(directory=root, models={"claude": Model("claude", "anthropic", model="claude-pinned",
                                                            base_url=url, api_key_env="RELAY_KEY")})
    hub = RelayHub(config, layout, {"RELAY_KEY": SecretValue("RELAY_KEY", key)}, Redactor([key]),
                   state_dir=root / "state", limits=limits)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": True}), flush=True)
    try:
        while line := (await reader.readline()).decode().strip():
            word, _, arg = line.partition(" ")
            if word == "open":
                try:
                    answer = {"capability": await hub.open(arg, ["claude"], 0)}
                except OSError as exc:
                    answer = {"error": f"{type(exc).__name__}: {exc.strerror or exc}"}
            elif word == "fds":
                answer = {"fds": len(os.listdir("/proc/self/fd"))}
            else:
                answer = {"error": f"unknown command {word!r}"}
            print(json.dumps(answer), flush=True)
    finally:
        await hub.aclose()


if __name__ == "__main__":
    root_, url_, key_, nofile_, mode = sys.argv[1:6]
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(nofile_), hard))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main(Path(root_), url_, key_, LIMITS_ON if mode == "on" else RelayLimits.off()))
