"""The rule -> test map behind docs/SECURITY.md.

    python -m tests.system.securitymap          # print what is missing
    python -m tests.system.securitymap --write  # refresh the test lists in docs/SECURITY.md

A test is "named after" rule N when its name starts with `test_rN_` (or a
run of rule prefixes such as `test_r1_r2_...`). docs/SECURITY.md keeps, per
rule, a generated list between `<!-- tests RN -->` and `<!-- end tests RN -->`;
the prose around it (the code that enforces the rule) is written by hand.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "SECURITY.md"
# Every rule of SECURITY-MODEL.md has code behind it and a section in docs/SECURITY.md.
RULES = tuple(range(1, 46))
PREFIX = re.compile(r"^test_((?:r\d+_)+)")
TEST_REF = re.compile(r"`(tests/[\w/.\-]+\.py)::([\w\[\]\-]+)`")
CODE_REF = re.compile(r"`((?:services|gateway|deploy|bench)/[\w/.\-]+?)(?:::([\w.]+))?`")


def rules_of(name: str) -> list[int]:
    m = PREFIX.match(name)
    return [int(r) for r in re.findall(r"r(\d+)_", m.group(1))] if m else []


def collect(root: Path = ROOT) -> dict[int, list[tuple[str, str]]]:
    """rule -> [(path, test name)] for every test function named after a rule."""
    out: dict[int, list[tuple[str, str]]] = {n: [] for n in RULES}
    for path in sorted((root / "tests").rglob("test_*.py")):
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        rel = str(path.relative_to(root))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in rules_of(node.name):
                    if n in out:
                        out[n].append((rel, node.name))
    return out


def test_exists(path: str, name: str, root: Path = ROOT) -> bool:
    p = root / path
    if not p.is_file():
        return False
    base = name.split("[", 1)[0]
    return re.search(rf"^\s*(?:async\s+)?def {re.escape(base)}\(", p.read_text(), re.MULTILINE) is not None


def code_exists(path: str, symbol: str | None, root: Path = ROOT) -> bool:
    p = root / path
    if not p.exists():
        return False
    if not symbol:
        return True
    last = symbol.split(".")[-1]
    return re.search(rf"^\s*(?:async\s+def|def|class)\s+{re.escape(last)}\b|^{re.escape(last)}\s*[:=]",
                     p.read_text(), re.MULTILINE) is not None


def problems(doc: str, tests: dict[int, list[tuple[str, str]]], root: Path = ROOT) -> list[str]:
    out = []
    for n in RULES:
        if not tests.get(n):
            out.append(f"R{n}: no test is named after it (def test_r{n}_...)")
        if not re.search(rf"^## R{n}\b", doc, re.MULTILINE):
            out.append(f"R{n}: docs/SECURITY.md has no section '## R{n}'")
    for path, name in TEST_REF.findall(doc):
        if not test_exists(path, name, root):
            out.append(f"docs/SECURITY.md names {path}::{name}, which does not exist")
    for path, symbol in CODE_REF.findall(doc):
        if not code_exists(path, symbol or None, root):
            out.append(f"docs/SECURITY.md names {path}{'::' + symbol if symbol else ''}, which does not exist")
    for n in RULES:   # a section's tests must be about that rule
        m = re.search(rf"<!-- tests R{n} -->(.*?)<!-- end tests R{n} -->", doc, re.DOTALL)
        if m:
            for _path, name in TEST_REF.findall(m.group(1)):
                if n not in rules_of(name):
                    out.append(f"R{n}: lists {name}, which is not named after R{n}")
    return out


def render(doc: str, tests: dict[int, list[tuple[str, str]]]) -> str:
    for n in RULES:
        lines = "\n".join(f"- `{p}::{t}`" for p, t in tests.get(n, [])) or "- (none yet)"
        block = f"<!-- tests R{n} -->\n{lines}\n<!-- end tests R{n} -->"
        doc, count = re.subn(rf"<!-- tests R{n} -->.*?<!-- end tests R{n} -->", lambda _m, block=block: block, doc,
                             flags=re.DOTALL)
        if not count:
            raise SystemExit(f"docs/SECURITY.md: no '<!-- tests R{n} -->' block")
    return doc


def main(argv: list[str]) -> int:
    tests = collect()
    doc = DOC.read_text()
    if "--write" in argv:
        doc = render(doc, tests)
        DOC.write_text(doc)
    found = problems(doc, tests)
    for p in found:
        print(p)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
