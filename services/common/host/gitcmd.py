"""Running host git safely (R1, R2).

Every git process gets a fixed environment built from nothing (no inherited
`GIT_*`, trace or curl variables, no system or global config, an empty
HOME), `-c` hardening as defence in depth, and argv lists only. Callers put
`--end-of-options` / `--` before any path or user-influenced argument.
The token, when needed, is added to the environment of that one process and
is answered by the askpass helper; it is never in argv. The operator's
`AFE_CA_FILE` (as `GIT_SSL_CAINFO`) and HTTP(S) proxies are the only
settings taken from outside (R33).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import AfeError, DeadlineExceeded
from services.common.secrecy.redact import Redactor

log = logging.getLogger(__name__)

SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Defence in depth: even if some config were read, these win (command line
# config has the highest precedence).
HARDENING = (
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "core.sshCommand=false",
    "core.attributesFile=/dev/null",
    "core.pager=cat",
    "core.symlinks=true",
    "core.quotePath=false",
    "credential.helper=",
    "protocol.allow=never",
    "protocol.https.allow=always",
    "submodule.recurse=false",
    "fetch.recurseSubmodules=false",
    "push.recurseSubmodules=no",
    "commit.gpgSign=false",
    "tag.gpgSign=false",
    "transfer.fsckObjects=true",
    "gc.auto=0",
    "maintenance.auto=false",
    "init.templateDir=",
    "advice.detachedHead=false",
    "http.followRedirects=initial",
)


@dataclass(frozen=True)
class GitResult:
    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")


class GitFailed(AfeError):
    """git exited non-zero; `stderr` is already redacted."""

    code = "INTERNAL"

    def __init__(self, message: str, returncode: int, stderr: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr


class GitRunner:
    """Builds the argv and environment of every host git process."""

    def __init__(self, home: Path, redactor: Redactor, *, ca_file: Path | None = None,
                 proxies: Mapping[str, str] | None = None, timeout_s: float = 600.0, git: str = "git") -> None:
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.home = home
        self.redactor = redactor
        self.ca_file = ca_file
        self.proxies = dict(proxies or {})    # the operator's http(s)_proxy / no_proxy, for curl inside git
        self.timeout_s = timeout_s
        self.git = git

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {
            "PATH": SAFE_PATH,
            "HOME": str(self.home),
            "XDG_CONFIG_HOME": str(self.home),
            "LANG": "C",
            "LC_ALL": "C",
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_ATTR_NOSYSTEM": "1",
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_NO_REPLACE_OBJECTS": "1",
            "GIT_PAGER": "cat",
            "GIT_EDITOR": "false",
            "GIT_SSH_COMMAND": "false",
        }
        if self.ca_file is not None:
            env["GIT_SSL_CAINFO"] = str(self.ca_file)
        env.update(self.proxies)
        if extra:
            env.update(extra)
        return env

    def argv(self, args: list[str], *, git_dir: Path | None = None, work_tree: Path | None = None,
             allow_file: bool = False) -> list[str]:
        argv = [self.git]
        for item in HARDENING:
            argv += ["-c", item]
        if allow_file:
            argv += ["-c", "protocol.file.allow=always"]
        if git_dir is not None:
            argv.append(f"--git-dir={git_dir}")
        if work_tree is not None:
            argv.append(f"--work-tree={work_tree}")
        return argv + list(args)

    async def run(self, args: list[str], *, git_dir: Path | None = None, work_tree: Path | None = None,
                  env: dict[str, str] | None = None, stdin: bytes | None = None, allow_file: bool = False,
                  cwd: Path | None = None, check: bool = True, what: str = "git",
                  timeout_s: float | None = None) -> GitResult:
        argv = self.argv(args, git_dir=git_dir, work_tree=work_tree, allow_file=allow_file)
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.environment(env),
            cwd=str(cwd or self.home),
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s or self.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise DeadlineExceeded(f"{what} took longer than {timeout_s or self.timeout_s:.0f}s") from None
        except BaseException:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        res = GitResult(proc.returncode or 0, out, err)
        if check and res.returncode != 0:
            stderr = self.redactor.redact(res.err.strip())[-2000:]
            log.info("%s failed (exit %s): %s", what, res.returncode, stderr)
            raise GitFailed(f"{what} failed: {stderr or 'exit ' + str(res.returncode)}",
                            res.returncode, stderr)
        return res


__all__ = ["HARDENING", "SAFE_PATH", "GitFailed", "GitResult", "GitRunner"]
