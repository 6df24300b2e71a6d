"""Loading and validating the manifests of a config folder: the code is in
the `services.common.schema` package (one module per kind, the loader and
the secret scan); this module keeps the import path every process uses."""

from __future__ import annotations

from pathlib import Path

from services.common.config.model import Config
from services.common.schema import KINDS, manifest_json_schema, missing_env, parse_memory
from services.common.schema import loader as _loader

__all__ = ["KINDS", "load_config", "manifest_json_schema", "missing_env", "parse_memory"]


def load_config(directory: str | Path) -> Config:
    """Load and validate every manifest in `directory`; raise ConfigError listing every problem
    (`services/common/schema/loader.py::load_config`; secret-looking values refused, R27/R28)."""
    return _loader.load_config(directory)
