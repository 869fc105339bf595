"""The docs stay true without a docs build (see docs/README.md for why there is none).

* Every relative link and ``#anchor`` in README.md and docs/**/*.md resolves: the file exists and
  the anchor is a heading of it, as GitHub names headings.
* No code or page cites documents outside the repository (``shared/docs/...``), and every
  ``docs/*.md`` path the code names exists.
* Every python example in docs/ runs, each in a fresh namespace; the cast example does what it
  says.
* The spec pages' check vectors and constants are the code's: the tables are evaluated.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import qfa


def repo_root() -> Path:
    """The folder holding pyproject.toml, wherever under tests/ this file sits."""
    return next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


ROOT = repo_root()
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))
#: Where the library's code and its docs live: none of it may point outside the repository.
CITING = ("qfa", "kernels", "tiling", "csrc", "docs", "README.md")
TEXT_SUFFIXES = {".py", ".cpp", ".h", ".hpp", ".c", ".md", ".txt", ".toml", ".cfg"}
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans, where links are not links."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: its text (links and code marks reduced to their text),
    lower-cased, punctuation dropped except '-' and '_', spaces turned into '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page, repeated headings numbered as GitHub numbers them."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", FENCE.sub("", page.read_text()), flags=re.M):
        base = github_anchor(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links() -> list[tuple[Path, str]]:
    return [(page, target) for page in PAGES for target in LINK.findall(prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not checked here


def test_the_pages_are_there():
    names = {rel(p) for p in PAGES}
    assert {"README.md", "docs/README.md", "docs/usage.md", "docs/serving.md", "docs/accuracy.md",
            "docs/benchmarks.md", "docs/design.md", "docs/spec/hif8-format.md",
            "docs/spec/quant-flash-attn.md"} <= names
    assert len(links()) > 30, "the link check found almost no links: is the pattern still right?"


@pytest.mark.parametrize("page, target", links(), ids=[f"{rel(p)}->{t}" for p, t in links()])
def test_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.exists(), f"{rel(page)} links to {target!r}: {path} does not exist"
    assert ROOT in resolved.parents or resolved == ROOT, f"{rel(page)} links outside the repository: {target!r}"
    if anchor:
        assert resolved.suffix == ".md", f"{rel(page)}: an anchor into a non-Markdown file, {target!r}"
        assert anchor in anchors(resolved), (f"{rel(page)} links to #{anchor} in {rel(resolved)}, which has no "
                                             f"such heading")


def citing_files() -> list[Path]:
    files = []
    for name in CITING:
        top = ROOT / name
        candidates = [top] if top.is_file() else sorted(top.rglob("*"))
        files += [f for f in candidates if f.is_file() and f.suffix in TEXT_SUFFIXES and "__pycache__" not in f.parts]
    return files


def test_nothing_cites_documents_outside_the_repository():
    """The project's own spec is docs/spec/; a citation of ``shared/docs/...`` points at files
    that are not in the repository."""
    assert len(citing_files()) > 50
    bad = [f"{rel(f)}:{n}" for f in citing_files()
           for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if "shared/docs" in line]
    assert not bad, f"cites shared/docs (use docs/spec/... or docs/serving.md): {bad}"


def test_docs_paths_named_in_the_code_exist():
    code = [f for f in citing_files() if f.suffix != ".md"]
    named = {(rel(f), m) for f in code for m in re.findall(r"(?<![\w/.-])docs/[\w./-]*\.md", f.read_text(errors="replace"))}
    missing = sorted((f, m) for f, m in named if not (ROOT / m).is_file())
    assert not missing, f"the code names docs pages that do not exist: {missing}"


def doc_examples() -> list[tuple[Path, str, str]]:
    """(page, heading of the enclosing section, code) of every python block under docs/."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        heading = ""
        for part in re.split(r"(```python\n.*?```)", page.read_text(), flags=re.S):
            if part.startswith("```python\n"):
                found.append((page, heading, part[len("```python\n"):-3]))
            else:
                headings = re.findall(r"^#{1,6} (.+)$", part, flags=re.M)
                heading = headings[-1] if headings else heading
    return found


@pytest.mark.parametrize("index", range(len(doc_examples())),
                         ids=[f"{rel(p)}:{h}" for p, h, _ in doc_examples()])
def test_every_docs_example_runs(index):
    exec(doc_examples()[index][2], {})


def test_cast_example():
    codes = [c for p, h, c in doc_examples() if p.name == "usage.md" and h == "The cast"]
    assert len(codes) == 1
    ns: dict = {}
    exec(codes[0], ns)
    assert ns["codes"].shape == ns["x"].shape and ns["codes"].dtype == torch.uint8
    assert ns["back"].dtype == torch.float32 and torch.isinf(ns["back"]).sum() == 0
    assert torch.isinf(ns["qfa"].decode_from_hifloat8(ns["inf_codes"], torch.float32)).any()


def nextbelow(x: float) -> float:
    """The largest fp32 value below ``x``."""
    return float(np.nextafter(np.float32(x), np.float32(-math.inf)))


#: Names a spec table's cells may use, besides the code they cite.
SPEC_NAMES = {"nextbelow": nextbelow, "inf": math.inf, "nan": math.nan, "FLT_MAX": torch.finfo(torch.float32).max,
              "qfa": qfa}


def evaluate(cell: str):
    """A table cell written as a Python expression (in backticks), evaluated; the qfa modules it
    names are imported first."""
    expression = cell.strip().strip("`")
    for dotted in re.findall(r"\bqfa(?:\.\w+)+", expression):
        parts = dotted.split(".")
        for i in range(2, len(parts) + 1):
            try:
                __import__(".".join(parts[:i]))
            except ImportError:
                break
    return eval(expression, {"__builtins__": {"len": len}}, SPEC_NAMES)


def table(page: str, section: str) -> list[list[str]]:
    """The body rows of the first table under ``## section`` of a docs page, as lists of cells."""
    text = (DOCS / page).read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]
    return [row for row in cells[2:] if row]  # past the header and its rule


def same(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def test_hif8_check_vectors_are_the_encoders():
    rows = table("spec/hif8-format.md", "Check vectors")
    assert len(rows) >= 20
    x = torch.tensor([evaluate(r[0]) for r in rows], dtype=torch.float32)
    saturate = qfa.encode_to_hifloat8(x).tolist()
    inf = qfa.encode_to_hifloat8(x, overflow="inf").tolist()
    decoded = qfa.decode_from_hifloat8(torch.tensor(saturate, dtype=torch.uint8), torch.float32).tolist()
    for row, s, i, d in zip(rows, saturate, inf, decoded):
        assert (s, i) == (evaluate(row[1]), evaluate(row[2])), f"{row[0]}: the encoder gives {s:#04x} / {i:#04x}"
        assert same(d, float(evaluate(row[3]))), f"{row[0]}: {row[1]} decodes to {d}"


@pytest.mark.parametrize("page", ["spec/hif8-format.md", "spec/quant-flash-attn.md"])
def test_spec_constants_are_the_codes(page):
    rows = table(page, "Constants")
    assert len(rows) >= 10
    for name, value, code in rows:
        assert same(evaluate(code), evaluate(value)), f"{page}: {name} is {evaluate(code)!r} in {code}, not {value}"


def test_design_names_every_csrc_header_and_only_those():
    """design.md's table of the native kernel's headers stays the folder's."""
    rows = table("design.md", "The native CPU kernel")
    named = {row[0].strip("`") for row in rows if row[0].startswith("`")}
    assert named == {p.name for p in (ROOT / "csrc").glob("*.h")}
