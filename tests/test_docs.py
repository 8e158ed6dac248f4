"""The newcomer's docs stay short and true: docs/architecture.md (the map) and docs/bench.md
(the benchmarks' user's guide) are held to a length, carry no issue numbers, and every path,
symbol and link they cite exists in this repository.

What counts as a citation:

- a path in backticks: from the repository root (``src/...``, ``benchmarks/...``,
  ``tests/...``, ``docs/...``), from ``src/hlserve`` (``engine/scheduler.py``, ``llm.py``) or
  from ``src`` (``hlserve/...``); a bare file name (``routes.py``) must name some file of the
  package, the benchmarks or the tests; a path in a code block that ends in ``.py`` or ``.md``;
- a symbol: ``module.py:Name`` or ``package/module.py:Class.method`` (defined in that file:
  a top-level def, class or assignment, then a method or attribute of the class), and a dotted
  ``hlserve.module.Name`` anywhere (defined or imported there);
- a Markdown link to a file of the repository, and its ``#anchor`` (a heading of that file,
  as GitHub spells anchors).

Everything is read with ``ast`` and ``pathlib``; nothing is imported, so this runs in a
moment and needs no torch.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "hlserve"

# doc -> the length it must stay under, in lines
DOCS = {"docs/architecture.md": 250, "docs/bench.md": 600}

# where a path in backticks starts when it names a file of this repository
ROOT_DIRS = ("src", "benchmarks", "tests", "docs", "hlserve")
PACKAGE_DIRS = ("bench", "cli", "data", "driver", "engine", "integrations", "models", "runner",
                "server", "sim", "structured", "study")
FILE_SUFFIXES = (".py", ".md", ".json", ".toml", ".cpp", ".h", ".png", ".txt", ".jsonl")
# file names the docs mention that are not this repository's: the coding workload's synthetic
# repository has a common.py
NOT_REPOSITORY_FILES = {"common.py"}

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
DOTTED = re.compile(r"(?<![\w.])hlserve(?:\.[A-Za-z_]\w*)+")
FENCED_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|md))\b")
ISSUE_WORD = re.compile(r"\bissues?\s+#?\d+", re.I)
ISSUE_HASH = re.compile(r"(?<![\w&])#\d+\b")


# ---- reading a doc ------------------------------------------------------------------------------


def split_doc(text: str) -> tuple[str, str]:
    """(prose with inline code, the fenced code blocks' text)."""
    fences = "\n".join(m.group(0) for m in FENCE.finditer(text))
    return FENCE.sub("", text), fences


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces
    to hyphens; a repeated one gets -1, -2, ..."""
    prose, _ = split_doc(text)
    seen: dict[str, int] = {}
    anchors = set()
    for m in re.finditer(r"^#{1,6} (.+?)\s*$", prose, re.M):
        words = m.group(1).replace("`", "").strip().lower()
        slug = "".join(c for c in words if c.isalnum() or c in " -_").replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def issue_numbers(text: str) -> list[str]:
    """Issue references outside code and link targets ("issue 24", "#26")."""
    prose, _ = split_doc(text)
    prose = INLINE_CODE.sub("", LINK.sub("", prose))
    return ISSUE_WORD.findall(prose) + ISSUE_HASH.findall(prose)


# ---- resolving a citation -----------------------------------------------------------------------


@functools.cache
def files_named(name: str) -> tuple[Path, ...]:
    found: list[Path] = []
    for top in (PACKAGE, ROOT / "benchmarks", ROOT / "tests"):
        found += top.rglob(name)
    return tuple(found)


def candidates(path: str) -> list[Path]:
    """Where a cited path may be: the repository root, src/hlserve, src; a bare file name
    anywhere in the package, the benchmarks or the tests."""
    if "/" not in path.rstrip("/"):
        return [ROOT / path, *files_named(path)]
    return [ROOT / path, PACKAGE / path, ROOT / "src" / path]


def is_repository_path(span: str) -> bool:
    if not re.fullmatch(r"[\w./-]+", span) or span in NOT_REPOSITORY_FILES:
        return False
    first = span.split("/")[0]
    if "/" in span.rstrip("/"):
        return first in ROOT_DIRS + PACKAGE_DIRS and (span.endswith("/") or
                                                      span.endswith(FILE_SUFFIXES))
    return span.endswith(".py")


def path_exists(path: str) -> bool:
    return any(p.exists() for p in candidates(path))


@functools.cache
def module_tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _names(body: list[ast.stmt], imports: bool) -> dict[str, ast.stmt]:
    """Names a module or class body binds: defs, classes, assignments (and, with ``imports``,
    imports), looking into top-level ``if`` and ``try`` blocks."""
    out: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        out[name.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif imports and isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try)):
            inner = node.body + node.orelse + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                inner += handler.body
            out.update(_names(inner, imports))
    return out


def defines(path: Path, symbol: str, imports: bool = False) -> bool:
    """``Name`` or ``Class.member`` is bound in the module at ``path``."""
    body: list[ast.stmt] = module_tree(path).body
    parts = symbol.split(".")
    for i, part in enumerate(parts):
        node = _names(body, imports and i == 0).get(part)
        if node is None:
            return False
        if i < len(parts) - 1:
            if not isinstance(node, ast.ClassDef):
                return False
            body = node.body
    return True


def symbol_exists(citation: str) -> bool:
    """``path/module.py:Name`` or ``path/module.py:Class.method``."""
    path, symbol = citation.split(":", 1)
    return any(p.is_file() and defines(p, symbol) for p in candidates(path))


def dotted_exists(name: str) -> bool:
    """``hlserve.package.module.Name``: the longest prefix that is a module, then symbols."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT / "src" / Path(*parts[:i])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = ".".join(parts[i:])
            return not rest or defines(module, rest, imports=True)
    return False


def link_problem(doc: Path, target: str) -> str | None:
    if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
        return None
    file_part, _, anchor = target.partition("#")
    dest = (doc.parent / file_part).resolve() if file_part else doc
    if not dest.exists():
        return f"{target}: no such file"
    if anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
        return f"{target}: no heading with that anchor in {dest.name}"
    return None


def citation_problems(doc: Path, text: str) -> list[str]:
    """Every citation of ``text`` (the doc at ``doc``) that does not resolve."""
    prose, fences = split_doc(text)
    bad: list[str] = []
    for span in INLINE_CODE.findall(prose):
        span = span.strip()
        head = span.split(":", 1)[0]
        if ":" in span and head.endswith(".py") and re.fullmatch(r"[\w./-]+", head):
            if not symbol_exists(span):
                bad.append(f"`{span}`: no such file or symbol")
        elif is_repository_path(span) and not path_exists(span):
            bad.append(f"`{span}`: no such path")
    for path in FENCED_PATH.findall(fences):
        if path not in NOT_REPOSITORY_FILES and not path_exists(path):
            bad.append(f"{path} (in a code block): no such path")
    for name in DOTTED.findall(prose + "\n" + fences):
        if not dotted_exists(name):
            bad.append(f"{name}: no such module or symbol")
    for target in LINK.findall(prose):
        if (problem := link_problem(doc, target)) is not None:
            bad.append(problem)
    return sorted(set(bad))


# ---- the docs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DOCS)
def test_doc_is_short(name: str) -> None:
    lines = (ROOT / name).read_text(encoding="utf-8").count("\n")
    assert lines < DOCS[name], f"{name} has {lines} lines; keep it under {DOCS[name]}"


@pytest.mark.parametrize("name", DOCS)
def test_doc_cites_no_issue_numbers(name: str) -> None:
    assert issue_numbers((ROOT / name).read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("name", DOCS)
def test_doc_citations_exist(name: str) -> None:
    doc = ROOT / name
    assert citation_problems(doc, doc.read_text(encoding="utf-8")) == []


# ---- the checks themselves ---------------------------------------------------------------------


def test_checks_catch_what_does_not_exist() -> None:
    """A doc citing a missing path, symbol, method, module or anchor fails; one citing what
    exists passes."""
    doc = ROOT / "docs" / "architecture.md"
    good = ("`engine/batch.py`, `engine/batch.py:Runner.execute`, `hlserve.request.Request`, "
            "`tests/test_docs.py`, [the guide](bench.md#headline-results)\n"
            "```\npython benchmarks/fidelity.py\n```\n")
    assert citation_problems(doc, good) == []
    bad = ("`engine/no_such_module.py`, `engine/batch.py:NoSuchThing`, "
           "`engine/batch.py:Runner.no_such_method`, `hlserve.no_such_module.Name`, "
           "[a heading](bench.md#no-such-heading), [a file](no_such_file.md)\n"
           "```\npython benchmarks/no_such_script.py\n```\n")
    assert len(citation_problems(doc, bad)) == 7


def test_issue_numbers_are_found_outside_code() -> None:
    assert issue_numbers("fixed in issue 24, see #26") == ["issue 24", "#26"]
    assert issue_numbers("`#26` and [x](y.md#4-section)\n```\nissue 3\n```\n") == []


def test_anchors_as_github_spells_them() -> None:
    text = "# A\n## Speculative decoding: `benchmarks/speculation.py`\n## Twice\n### Twice\n"
    assert heading_anchors(text) == {"a", "speculative-decoding-benchmarksspeculationpy",
                                     "twice", "twice-1"}
