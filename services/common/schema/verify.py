"""`verify:` of a Workflow — clean-room verification before merge (R41).

    verify:
      run: ["python -m pytest -q"]   # commands, templated like a run: node
      base_paths: [tests/]           # optional: taken from the base branch
      timeout: 900                   # seconds per command

The commands run on the head a person is asked to approve, in a fresh
sandbox of a fresh checkout (docs/GUIDE.md, "Verification before merge");
`builtin:merge` refuses a head whose verification did not pass.
`base_path_problem` is shared with the credential broker, which checks the
paths again before it builds the checkout.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.common.config.model import Verify

from .document import Doc
from .text import fields_of

DEFAULT_TIMEOUT_S = 900.0
MAX_COMMANDS = 20
MAX_BASE_PATHS = 50


class VerifyDecl(BaseModel):
    """Commands run on the final head in a fresh sandbox before the approval is asked (R41)."""
    model_config = ConfigDict(extra="forbid")
    run: list[Annotated[str, StringConstraints(min_length=1)]] = Field(
        min_length=1, max_length=MAX_COMMANDS,
        description="commands, in order, templated like a run: node (values as $1.., never shell code)")
    base_paths: list[Annotated[str, StringConstraints(min_length=1)]] = Field(
        default_factory=list, max_length=MAX_BASE_PATHS,
        description="paths relative to the repository root taken from the base branch's tip, e.g. tests/")
    timeout: float = Field(DEFAULT_TIMEOUT_S, gt=0, description="seconds per command")


def base_path_problem(raw: object) -> str:
    """Why `raw` is no base path ("" when it is one)."""
    if not isinstance(raw, str) or not raw.strip():
        return "is empty; name a folder or file of the repository, e.g. tests/"
    if not raw.isprintable() or "\\" in raw:
        return "holds a control character or a backslash; use a plain relative path like tests/"
    if any(c in raw for c in "*?[]{}"):
        prefix = raw[:min(raw.find(c) for c in "*?[]{}" if c in raw)]
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        where = f"{folder}/" if folder else "the folder that holds them, e.g. tests/"
        return (f"is a pattern, but base paths are taken literally; name {where} instead "
                "(every file under a folder is taken)")
    if raw.startswith("/"):
        return "is absolute; use a path relative to the repository root, e.g. tests/"
    parts = PurePosixPath(raw).parts
    if ".." in parts:
        return "contains '..'; use a path inside the repository, e.g. tests/"
    if not parts or parts == (".",):
        return "names the whole repository; name the folders to take from the base branch, e.g. tests/"
    if parts[0] == ".git":
        return "names git's own folder; name a folder of the repository's files"
    return ""


def harness_pattern_problem(raw: str) -> str:
    """Why `raw` is no entry of a Workspace's verifyHarness ("" when it is one): a path, a folder
    ending in / or a glob (`*` crosses /), relative to the repository root."""
    if not raw.strip() or raw.strip() != raw:
        return "is empty or starts or ends with a space; write a path such as scripts/ci.sh or ci/*.cfg"
    if raw.startswith("/") or "\\" in raw or not raw.isprintable():
        return "must be a plain path relative to the repository root, with / between names"
    if any(p in ("..", ".") for p in raw.rstrip("/").split("/")):
        return "must not contain . or .. components; write the path from the repository root"
    if raw.split("/", 1)[0] == ".git":
        return "names git's own folder; name files of the repository"
    return ""


def load_verify(doc: Doc, d: Mapping[str, Any]) -> Verify | None:
    if "verify" not in d:
        return None
    v = doc.mapping(d, "verify", "verify")
    if v is None:
        doc.error("verify", "must be a mapping: verify: {run: [\"make test\"], base_paths: [tests/]}")
        return None
    doc.fields(v, "verify", fields_of(VerifyDecl), ("run",))
    run = doc.str_list(v, "run", "verify.run", unique=False)
    if "run" in v and not run and isinstance(v.get("run"), list):
        doc.error("verify.run", "must not be empty; list the commands that must pass, e.g. [\"make test\"]")
    if len(run) > MAX_COMMANDS:
        doc.error("verify.run", f"at most {MAX_COMMANDS} commands; join some with &&")
    paths = doc.str_list(v, "base_paths", "verify.base_paths")
    raw = v.get("base_paths")
    for i, p in enumerate(raw if isinstance(raw, list) else []):
        problem = base_path_problem(p) if isinstance(p, str) and p else ""
        if problem:
            doc.error(f"verify.base_paths[{i}]", f"{p[:200]!r} {problem}")
    if len(paths) > MAX_BASE_PATHS:
        doc.error("verify.base_paths", f"at most {MAX_BASE_PATHS} paths; list fewer, wider folders")
    timeout = doc.number(v, "timeout", "verify.timeout", DEFAULT_TIMEOUT_S)
    if not run:
        return None
    return Verify(run=run, base_paths=tuple(p for p in paths if not base_path_problem(p)), timeout_s=timeout)
