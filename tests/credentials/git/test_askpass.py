"""R1: the askpass helper answers only git's two prompts for the expected
origin; any other host (a redirect, a submodule, a second remote) gets nothing."""

from __future__ import annotations

import subprocess

from services.common.host.askpass import askpass_env, write_helper


def _ask(helper, env, prompt: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helper), prompt], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, check=False)


def test_r1_askpass_answers_only_for_the_expected_origin(short_tmp):
    helper = write_helper(short_tmp / "bin")
    assert "secret" not in helper.read_text()
    assert oct(helper.parent.stat().st_mode & 0o777) == "0o700"
    token = "secret-token-value-42"
    env = askpass_env(helper, "https://git.example.test:8443/acme/widgets.git", token)
    user = _ask(helper, env, "Username for 'https://git.example.test:8443': ")
    password = _ask(helper, env, "Password for 'https://x-access-token@git.example.test:8443': ")
    # Positive control: the expected prompts get the user name and the token.
    assert (user.returncode, user.stdout) == (0, b"x-access-token\n")
    assert (password.returncode, password.stdout) == (0, token.encode() + b"\n")
    for prompt in ("Password for 'https://x-access-token@evil.test': ",
                   "Password for 'https://x-access-token@git.example.test': ",        # other port
                   "Password for 'http://x-access-token@git.example.test:8443': ",   # downgraded scheme
                   "Username for 'https://evil.test': ",
                   "Password for 'https://attacker@git.example.test:8443': ",
                   "Enter passphrase for key '/root/.ssh/id_rsa': ",
                   ""):
        res = _ask(helper, env, prompt)
        assert res.returncode != 0 and res.stdout == b"", prompt
