"""The GIT_ASKPASS helper (R1, R2).

The helper is a small `/bin/sh` script written once into a private folder.
It holds no secret: the token reaches it only through the environment of the
one git process that needs it, and it answers only the two prompts git makes
for the expected origin (`Username for 'https://host'`, `Password for
'https://user@host'`). Any other prompt -- another host, a redirect, a
submodule -- gets nothing and git fails. `printf` is a shell builtin, so the
token is never in an argv.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

from services.common.errors import InvalidArgument

USERNAME = "x-access-token"

SCRIPT = """#!/bin/sh
# afe GIT_ASKPASS helper: answers only for the expected origin.
if [ -n "$AFE_ASKPASS_USER_PROMPT" ] && [ "$1" = "$AFE_ASKPASS_USER_PROMPT" ]; then
  printf '%s\\n' "$AFE_ASKPASS_USERNAME"
  exit 0
fi
if [ -n "$AFE_ASKPASS_PASS_PROMPT" ] && [ "$1" = "$AFE_ASKPASS_PASS_PROMPT" ]; then
  printf '%s\\n' "$AFE_GIT_TOKEN"
  exit 0
fi
exit 1
"""


def write_helper(folder: Path) -> Path:
    """Write the helper into `folder` (created 0700) and return its path."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    path = folder / "askpass.sh"
    tmp = folder / f".askpass.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o700)
    try:
        os.write(fd, SCRIPT.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def origin_of(url: str) -> tuple[str, str]:
    """(scheme, host[:port]) of an https URL; refuses URLs carrying userinfo."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise InvalidArgument("the repository URL must be https://host/owner/name.git")
    if parts.username or parts.password:
        raise InvalidArgument("the repository URL must not contain credentials; "
                              "name the token's variable in the Workspace's tokenEnv instead")
    return parts.scheme, parts.netloc


def askpass_env(helper: Path, url: str, token: str) -> dict[str, str]:
    """Environment entries that let `helper` answer git's prompts for `url` only."""
    scheme, netloc = origin_of(url)
    return {
        "GIT_ASKPASS": str(helper),
        "AFE_ASKPASS_USERNAME": USERNAME,
        "AFE_ASKPASS_USER_PROMPT": f"Username for '{scheme}://{netloc}': ",
        "AFE_ASKPASS_PASS_PROMPT": f"Password for '{scheme}://{USERNAME}@{netloc}': ",
        "AFE_GIT_TOKEN": token,
    }
