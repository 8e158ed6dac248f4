"""benchmarks/check_study_doc.py: every number docs/study.md takes from the stored study points
agrees with the points, and a number edited away from them fails the check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_study_doc", ROOT / "benchmarks" / "check_study_doc.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_study_doc"] = mod
    spec.loader.exec_module(mod)
    return mod


csd = _module()


@pytest.fixture(scope="module")
def study():
    return csd.Study.load()


@pytest.fixture(scope="module")
def doc() -> str:
    return csd.DOC.read_text()


def test_committed_doc_agrees_with_points(doc: str, study) -> None:
    results = csd.check(doc, study)
    bad = [r for r in results if not r.ok]
    assert not bad, csd.table(bad)
    assert len(results) > 250  # the headline numbers and the tables, not a handful


@pytest.mark.parametrize(("old", "new", "claim"), [
    ("**32K: 18%.**", "**32K: 19%.**", "32K: tax, best meeting it, best [1]"),
    ("| 64K | 21.6K | 25.4K |", "| 64K | 21.6K | 26.4K |", "best at each concurrency, 64K [2]"),
    ("The 310 stored points record 5–542 s", "The 310 stored points record 5–50 s",
     "wall time per point [3]"),
    ("about 14× larger", "about 8× larger", "tool results 64K / 8K (the workload generator) [1]"),
    ("| 8K / 64 | 0.0% | 0.0% | +6.9% |", "| 8K / 64 | 0.0% | 0.0% | +5.9% |",
     "components 8K/64 [3]"),
    # section 7: the seeded, no-reuse and ITL numbers
    ("18% at 32K is 17.7 ± 1.4% over seeds", "18% at 32K is 17.7 ± 0.4% over seeds",
     "seeded 32K tax [2]"),
    ("| 32K | 2 s / 100 ms | 17.7 ± 1.4% | 100.0 ± 0.0% |",
     "| 32K | 2 s / 100 ms | 17.7 ± 1.4% | 60.0 ± 0.0% |", "no-reuse tax 32K 2 s / 100 ms [3]"),
    ("| sarathi C=B=512 | 65 | 85 | 85 / 87 |", "| sarathi C=B=512 | 65 | 58 | 85 / 87 |",
     "ITL row sarathi C=B=512 [2]"),
    ("turnover 0.06–0.83", "turnover 0.52–0.83", "64K/128 transient [1]"),
])
def test_a_wrong_number_fails(doc: str, study, old: str, new: str, claim: str) -> None:
    assert doc.count(old) == 1
    bad = [r for r in csd.check(doc.replace(old, new), study) if not r.ok]
    assert [r.claim for r in bad] == [claim]


def test_a_lost_quote_fails(doc: str, study) -> None:
    edited = doc.replace("The best without SLOs is", "Without SLOs the best is")
    bad = [r for r in csd.check(edited, study) if not r.ok]
    assert [(r.claim, r.in_doc) for r in bad] == [("32K: tax, best meeting it, best",
                                                    "quote not found")]


def test_numbers_and_rounding() -> None:
    assert csd.parse_number("−0.5") == (-0.5, 1)
    assert csd.parse_number("29,168") == (29168.0, 0)
    assert csd.agrees(18.0, 0, 18.4, "round") and not csd.agrees(18.0, 0, 18.6, "round")
    assert csd.agrees(142.0, 0, 142.9, "floor") and not csd.agrees(142.0, 0, 141.9, "floor")
    assert csd.agrees(8.0, 0, 7.5, "ceil") and not csd.agrees(8.0, 0, 8.1, "ceil")
    assert not csd.agrees(1.0, 0, float("nan"), "round")
