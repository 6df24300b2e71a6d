"""A ticket's text: the one set of limits for its title, body and inputs,
checked with the same model by the gateway (JSON-RPC `tickets.create`), the
scheduler (CreateTicket, whoever calls it) and the CLI (`afe ticket create`,
before it sends anything).

| what | limit |
|---|---|
| title | 1-200 characters after trimming spaces |
| body | at most 65,536 bytes of UTF-8 (64 KiB) |
| inputs | at most 64; names `[A-Za-z_][A-Za-z0-9_]{0,62}` (as a Workflow's `inputs`); each value at most 8,192 bytes of UTF-8 |

Each layer used to have its own (200 vs 500 characters, 65,536 characters vs
64 KiB of bytes, two name patterns); these are the stricter of each.
`problem(exc)` turns a pydantic error into one message that names the field
and says what to change.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from .text import INPUT_RE, INPUT_WHAT

__all__ = ["MAX_BODY_BYTES", "MAX_INPUTS", "MAX_INPUT_BYTES", "MAX_TITLE_CHARS", "TicketText", "problem"]

MAX_TITLE_CHARS = 200
MAX_BODY_BYTES = 64 * 1024
MAX_INPUTS = 64
MAX_INPUT_BYTES = 8 * 1024


def _title(value: str) -> str:
    title = value.strip()
    if not title:
        raise PydanticCustomError("title_empty", "must not be empty: the title is empty or blank; give the "
                                  "ticket a title")
    if len(title) > MAX_TITLE_CHARS:
        raise PydanticCustomError("title_long", "must be at most {limit} characters; the limit is {limit} and "
                                  "this title has {size}; shorten it", {"limit": MAX_TITLE_CHARS, "size": len(title)})
    return title


def _body(value: str) -> str:
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_BODY_BYTES:
        raise PydanticCustomError("body_long", "must be at most {limit} bytes of UTF-8 (64 KiB); this body has "
                                  "{size} bytes; shorten it", {"limit": MAX_BODY_BYTES, "size": size})
    return value


def _inputs(value: dict[str, str]) -> dict[str, str]:
    if len(value) > MAX_INPUTS:
        raise PydanticCustomError("inputs_many", "may hold at most {limit} entries", {"limit": MAX_INPUTS})
    for name, text in value.items():
        if not INPUT_RE.match(name):
            raise PydanticCustomError("input_name", "keys must be input names: {what}, at most 63",
                                      {"what": INPUT_WHAT})
        if len(text.encode("utf-8", "surrogatepass")) > MAX_INPUT_BYTES:
            raise PydanticCustomError("input_long", "entry '{name}' must be a string of at most {limit} "
                                      "bytes of UTF-8", {"name": name, "limit": MAX_INPUT_BYTES})
    return value


Title = Annotated[str, AfterValidator(_title),
                  Field(json_schema_extra={"minLength": 1, "maxLength": MAX_TITLE_CHARS})]
Body = Annotated[str, AfterValidator(_body), Field(description=f"at most {MAX_BODY_BYTES} bytes of UTF-8")]
Inputs = Annotated[dict[str, str], AfterValidator(_inputs),
                   Field(json_schema_extra={"maxProperties": MAX_INPUTS,
                                            "propertyNames": {"pattern": INPUT_RE.pattern}})]


class TicketText(BaseModel):
    """What a person writes into a ticket. `title` comes back trimmed."""
    model_config = ConfigDict(extra="forbid", strict=True)
    title: Title
    body: Body = ""
    inputs: Inputs = Field(default_factory=dict)


def _where(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


def problem(exc: ValidationError) -> str:
    """The first error of `exc` as "'field' what is wrong / what to write"."""
    err = exc.errors(include_url=False)[0]
    where, kind, ctx = _where(err["loc"]), err["type"], err.get("ctx") or {}
    fixed = {
        "missing": "is required",
        "string_type": "must be a string",
        "int_type": "must be an integer",
        "bool_type": "must be true or false",
        "dict_type": "must be an object of strings",
        "list_type": "must be a list of strings",
        "model_type": "must be an object",
    }
    if kind in fixed:
        text = fixed[kind]
    elif kind == "string_too_short":
        n = ctx.get("min_length", 1)
        text = "must not be empty" if n == 1 else f"must be at least {n} characters"
    elif kind == "string_too_long":
        text = f"must be at most {ctx.get('max_length')} characters"
    elif kind == "too_long":
        text = f"may hold at most {ctx.get('max_length')} entries"
    elif kind == "greater_than_equal":
        text = f"must be at least {ctx.get('ge')}"
    elif kind == "less_than_equal":
        text = f"must be at most {ctx.get('le')}"
    elif kind == "literal_error":
        text = f"must be one of: {str(ctx.get('expected', '')).replace(' or ', ', ')}"
    else:
        text = err["msg"]
    return f"'{where}' {text}" if where else text
