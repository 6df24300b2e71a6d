"""Every command the README and docs/*.md show running in a sandbox exists there
(issue 35: the GUIDE's `verify:` ran `python -m pytest -q`, which exits 127 in
afe's images, and every merge was refused).

The commands are read from the manifests in the pages' ```yaml blocks: each
`run:` of a node and each command of `verify.run`. Every image a manifest
runs them in starts FROM afe/sandbox:latest (project images, agent preset
images), so each must work there: its programs (the first word of each
simple command, after `VAR=value`) are found by `command -v` in bash, as a
`run:` node runs, and a `python3 -m MODULE`'s module is importable. One
`docker run` checks them all. A page that needs more than that image has
(pytest, npm) says so with a project image and the Dockerfile that adds it.

Positive control: planted commands (`python -m pytest -q`, the GUIDE's old
one, and a program that exists nowhere) are caught by the same check.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from services.common.host.images import SANDBOX_IMAGE
from services.common.secrecy.childenv import docker_cli_env

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")", "!", "{", "}"}
REDIRECTS = re.compile(r"^\d*[<>]")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")

PLANTED = """\
```yaml
kind: Workflow
name: planted
workspace: w
verify:
  run: ["python -m pytest -q"]
nodes:
  - {id: t, run: "cd sub && afe-no-such-program --check | python3 -m afe_no_such_module"}
```
"""


@dataclass(frozen=True)
class Command:
    where: str      # page:line and the manifest field
    text: str


def _yaml_blocks(text: str) -> list[tuple[int, str]]:
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```ya?ml[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)]


def _documents(block: str) -> list[object]:
    """The block's YAML documents; a fragment's `...` (text left out) lines are dropped first."""
    body = textwrap.dedent(block)
    try:
        return list(yaml.safe_load_all(body))
    except yaml.YAMLError:
        kept = "\n".join(ln for ln in body.splitlines() if ln.strip() != "...")
        return list(yaml.safe_load_all(textwrap.dedent(kept)))


def _runs(node: object, field: str = "") -> list[tuple[str, str]]:
    """(field, command) of every `run:` below `node`: a node's string, verify's list."""
    found: list[tuple[str, str]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            name = f"{field}.{key}" if field else str(key)
            if key == "run" and isinstance(value, str):
                found.append((name, value))
            elif key == "run" and isinstance(value, list):
                found += [(f"{name}[{i}]", v) for i, v in enumerate(value) if isinstance(v, str)]
            else:
                found += _runs(value, name)
    elif isinstance(node, list):
        for item in node:
            found += _runs(item, field)
    return found


def commands_of(page: str, text: str) -> list[Command]:
    out = []
    for line, block in _yaml_blocks(text):
        for doc in _documents(block):
            out += [Command(f"{page}:{line} {field}", cmd) for field, cmd in _runs(doc)]
    return out


def needs(command: str) -> tuple[set[str], set[str]]:
    """(programs, python modules) a bash command runs."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    programs, modules = set(), set()
    words: list[str] = []

    def end() -> None:
        while words and ASSIGNMENT.match(words[0]):
            words.pop(0)
        if words:
            programs.add(words[0])
            if words[0].startswith("python") and len(words) > 2 and words[1] == "-m":
                modules.add(words[2])
        words.clear()

    tokens = list(lexer)
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok in OPERATORS:
            end()
        elif REDIRECTS.match(tok):
            i += 1          # the redirection's target is no word of the command
        else:
            words.append(tok)
        i += 1
    end()
    return programs, modules


def missing_in_image(commands: list[Command], image: str = SANDBOX_IMAGE) -> list[str]:
    """What each command needs that `image` lacks, one line per command; one docker run for all."""
    programs, modules = set(), set()
    for c in commands:
        p, m = needs(c.text)
        programs |= p
        modules |= m
    probe = ["set +e"]
    probe += [f"command -v {shlex.quote(p)} >/dev/null 2>&1 || echo program {shlex.quote(p)}"
              for p in sorted(programs)]
    find = "import importlib.util as u, sys; sys.exit(u.find_spec({!r}) is None)"
    probe += [f"python3 -c {shlex.quote(find.format(m))} 2>/dev/null || echo module {shlex.quote(m)}"
              for m in sorted(modules)]
    r = subprocess.run(["docker", "run", "--rm", "--network=none", image, "bash", "-c", "\n".join(probe)],
                       capture_output=True, text=True, timeout=90, check=False, env=docker_cli_env())
    assert r.returncode == 0, f"docker run {image} failed: {r.stderr}"
    absent = {tuple(line.split(" ", 1)) for line in r.stdout.splitlines() if line.strip()}
    problems = []
    for c in commands:
        p, m = needs(c.text)
        lack = sorted(f"`{x}`" for x in p if ("program", x) in absent)
        lack += sorted(f"python module `{x}`" for x in m if ("module", x) in absent)
        if lack:
            problems.append(f"{c.where}: {c.text!r} needs {', '.join(lack)}, which {image} lacks")
    return problems


def doc_commands() -> list[Command]:
    return [c for page in PAGES for c in commands_of(str(page.relative_to(ROOT)), page.read_text())]


def test_the_docs_show_commands_to_check():
    """The extraction finds the manifests' commands (a parser that finds none would pass anything)."""
    texts = {c.text for c in doc_commands()}
    assert "python3 -m unittest -v" in texts               # docs/GUIDE.md, the walkthrough's workflow
    assert len(texts) >= 5, texts


def test_every_command_in_the_docs_exists_in_the_sandbox_image():
    commands = doc_commands()
    planted = commands_of("planted.md", PLANTED)
    problems = missing_in_image(commands + planted)
    # Positive control, from the same docker run: the planted commands are caught.
    caught = [p for p in problems if p.startswith("planted.md")]
    assert len(caught) == 2, caught
    assert "verify.run[0]: 'python -m pytest -q' needs `python`" in caught[0]
    assert "`afe-no-such-program`, python module `afe_no_such_module`" in caught[1]
    assert "`cd`" not in caught[1] and "`python3`" not in caught[1]
    assert [p for p in problems if not p.startswith("planted.md")] == []


def test_needs_reads_programs_and_modules_as_bash_would():
    assert needs('A=1 B=2 make -C x && ./run.sh; echo "a && b" > out.txt') == \
        ({"make", "./run.sh", "echo"}, set())
    assert needs("python3 -m pytest -q tests/ | tee log 2>&1") == ({"python3", "tee"}, {"pytest"})
    assert needs(". /etc/profile && ruff check {{ticket.inputs.path}}") == ({".", "ruff"}, set())
