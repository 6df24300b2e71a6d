"""R34: `sandbox.limits.disk`, the workspace's disk cap, in the Workspace
manifest: a default of 10g, sizes such as 10g or 512m, and a refusal naming
the field for anything else (0, negative, not a size, below 16m)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from services.common.config.manifests import load_config
from services.common.errors import ConfigError

WORKSPACE = """\
kind: Workspace
name: shop
repo: repos/shop.git
"""


def _load(tmp: Path, limits: str | None):
    text = WORKSPACE + (f"sandbox:\n  limits: {limits}\n" if limits is not None else "")
    (tmp / "afe.yaml").write_text(textwrap.dedent(text))
    return load_config(tmp).workspaces["shop"].sandbox.limits


def test_r34_disk_defaults_to_10g(tmp_path):
    assert _load(tmp_path, None).disk_bytes == 10 * 1024 ** 3
    assert _load(tmp_path, "{memory: 512m}").disk_bytes == 10 * 1024 ** 3


@pytest.mark.parametrize(("value", "expected"), [
    ("10g", 10 * 1024 ** 3), ("512m", 512 * 1024 ** 2), ("16m", 16 * 1024 ** 2), ("1.5GiB", 1536 * 1024 ** 2),
    (str(64 * 1024 ** 2), 64 * 1024 ** 2)])
def test_r34_disk_sizes_are_accepted(tmp_path, value, expected):
    assert _load(tmp_path, f"{{disk: {value}}}").disk_bytes == expected


@pytest.mark.parametrize(("value", "says"), [
    ("0", "is not a disk size"), ("'0'", "is not a disk size"), ("-1", "is not a disk size"),
    ("'-1g'", "is not a disk size"), ("lots", "'lots' is not a disk size"), ("true", "is not a disk size"),
    ("null", "is not a disk size"), ("[1g]", "is not a disk size"),
    ("8m", "'8m' is below the minimum of 16m"), ("15m", "below the minimum of 16m"),
    ("32t", "above the maximum of 16t")])
def test_r34_bad_disk_values_are_refused_naming_the_field(tmp_path, value, says):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, f"{{disk: {value}}}")
    message = str(info.value)
    assert "afe.yaml#1 sandbox.limits.disk:" in message and says in message, message


def test_r34_afe_check_names_the_disk_field(tmp_path, capsys):
    from services.cli.main import main

    (tmp_path / "afe.yaml").write_text(WORKSPACE + "sandbox: {limits: {disk: lots}}\n")
    assert main(["check", "--config", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "afe.yaml#1 sandbox.limits.disk: 'lots' is not a disk size" in err and "10g" in err
    # Positive control: the same manifest with a size passes (afe check also opens the repository).
    from tests.support.fakes.git_http import make_bare_repo

    (tmp_path / "repos").mkdir()
    make_bare_repo(tmp_path / "repos", "shop.git", {"README.md": "x\n"})
    (tmp_path / "afe.yaml").write_text(WORKSPACE + "sandbox: {limits: {disk: 10g}}\n")
    assert main(["check", "--config", str(tmp_path)]) == 0
