"""Shared fixtures. Area fixtures live in each tests/<area>/conftest.py."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from services.common.layout import Layout


@pytest.fixture
def short_tmp():
    """A short temporary folder: Unix socket paths are limited to 107 bytes."""
    d = tempfile.mkdtemp(prefix="afe-", dir="/tmp")
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def layout(short_tmp) -> Layout:
    lay = Layout(short_tmp / "data", short_tmp / "run")
    lay.ensure()
    return lay


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    d = Path(os.environ.get("AFE_TEST_ARTIFACTS", "test-artifacts")).absolute()
    d.mkdir(parents=True, exist_ok=True)
    return d
