"""kind: Model — an LLM API (openai, anthropic, gemini) or a replay script.

`ModelManifest` declares the fields; `load` checks one document and adds a
`config.Model`. The key is never written here, only its variable's NAME
(apiKeyEnv, R28)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.common.config.model import Model

from .document import Doc, check_api_url
from .text import ENV_NAME_RE, NAME_RE

if TYPE_CHECKING:
    from .collected import Collected as Loader

PROVIDERS = ("openai", "anthropic", "gemini", "replay")
DEFAULT_BASE_URLS = {"openai": "https://api.openai.com/v1", "anthropic": "https://api.anthropic.com",
                     "gemini": "https://generativelanguage.googleapis.com"}


class ModelPrice(BaseModel):
    """What a Model's tokens cost: USD per million tokens, by direction."""
    model_config = ConfigDict(extra="forbid")
    input: float = Field(ge=0, description="USD per million input (prompt) tokens")
    output: float = Field(ge=0, description="USD per million output (completion) tokens")


class ModelManifest(BaseModel):
    """A model API the engine (model nodes) or an agent (through the relay) calls."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    kind: Literal["Model"]
    name: Annotated[str, StringConstraints(pattern=NAME_RE.pattern)]
    provider: Literal["openai", "anthropic", "gemini", "replay"]
    model: str | None = Field(None, description="the provider's model id (required except for replay)")
    baseUrl: str | None = Field(None, description="https://, or http:// to localhost; default: the provider's")
    apiKeyEnv: Annotated[str, StringConstraints(pattern=ENV_NAME_RE.pattern)] | None = Field(
        None, description="the NAME of the variable holding the API key (R28)")
    script: str | None = Field(None, description="replay: the file of scripted responses, relative to "
                               "the config folder")
    maxTokens: int = Field(4096, ge=1)
    timeout: float = Field(120.0, gt=0, description="seconds per request")
    price: ModelPrice | None = Field(None, description="USD per million tokens, for the cost estimate "
                                     "(services/common/cost.py); unset: cost not estimated")


def load(loader: Loader, doc: Doc, d: Mapping[str, Any], name: str | None) -> None:
    doc.fields(d, "", ("kind", "name", "provider", "model", "baseUrl", "apiKeyEnv", "script", "maxTokens",
                       "timeout", "price"), ("provider",))
    provider = doc.choice(d, "provider", "provider", PROVIDERS)
    model = doc.text(d, "model", "model", "")
    base_url = doc.text(d, "baseUrl", "baseUrl", DEFAULT_BASE_URLS.get(provider or "", ""))
    if isinstance(d.get("baseUrl"), str) and d["baseUrl"].strip():
        check_api_url(doc, d["baseUrl"], "baseUrl")
    api_key_env = doc.env_name(d, "apiKeyEnv", "apiKeyEnv")
    script: Path | None = None
    raw_script = doc.text(d, "script", "script", None)
    if provider == "replay":
        if "script" not in d:
            doc.error("script", "a replay model needs script: <file of scripted responses, relative to "
                      "the config folder>")
        elif raw_script is not None:
            script = Path(raw_script).expanduser()
            if not script.is_absolute():
                script = loader.directory / script
            script = script.resolve()
            if not script.is_file():
                doc.error("script", "file not found; create it or fix the path (relative to the config "
                          "folder)")
    elif provider in ("openai", "anthropic", "gemini"):
        if "script" in d:
            doc.error("script", "only replay models take a script; remove it")
        if not model and "model" not in d:
            doc.error("model", f"required for provider {provider}; add model: <model id>")
    max_tokens = doc.integer(d, "maxTokens", "maxTokens", 4096, minimum=1)
    timeout = doc.number(d, "timeout", "timeout", 120.0)
    price = _price(doc, d)
    if doc.named and name is not None and provider is not None:
        loader.models[name] = Model(name=name, provider=provider, model=model, base_url=base_url.rstrip("/"),
                                  api_key_env=api_key_env, script=script, max_tokens=max_tokens,
                                  timeout_s=timeout, source=doc.where, price=price)


def _price(doc: Doc, d: Mapping[str, Any]) -> tuple[float, float] | None:
    """`price: {input: <USD per million tokens>, output: <USD per million tokens>}`, both required."""
    p = doc.mapping(d, "price", "price")
    if p is None:
        return None
    if not doc.fields(p, "price", ("input", "output"), ("input", "output"),
                      hint=" (USD per million tokens, e.g. price: {input: 3, output: 15})"):
        return None
    values = []
    for key in ("input", "output"):
        v = p[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            doc.error(f"price.{key}", "must be a number of US dollars per million tokens, 0 or more")
            return None
        values.append(float(v))
    return values[0], values[1]

