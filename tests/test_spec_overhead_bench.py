"""benchmarks/spec_overhead.py runs whole at tiny sizes (a smoke run, no timed assertion):
each arm's scheduler passes are timed with every request decoding, the proposers are the
real ones, and the indexed and scanning n-gram arms draft the same tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from support import load_benchmark

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    return load_benchmark("spec_overhead")


def test_the_benchmark_runs_at_tiny_sizes(tmp_path: Path, monkeypatch, capsys) -> None:
    bench = _bench()
    out = tmp_path / "o.json"
    monkeypatch.setattr(sys, "argv", ["spec_overhead.py", "--sessions", "4", "--contexts", "256",
                                      "--steps", "3", "--repeats", "1", "--out", str(out)])
    bench.main()
    runs = json.loads(out.read_text())["runs"]
    assert [r["arm"] for r in runs] == ["off", "ngram", "ngram-scan", "ngram-scan", "ngram", "off"]
    assert all(r["decoding"] == 4 and r["median_ms"] > 0 for r in runs)
    assert capsys.readouterr().out.count("| 4 | 256 |") == 3


def test_indexed_and_scanning_arms_draft_alike() -> None:
    """Both proposers over one engine's requests: the same drafts, request by request."""
    bench = _bench()
    engine = bench.engine_for("ngram", 64, 2)
    scan = bench.ScanSpeculator()
    index = engine.spec.speculator
    contexts = [[1, 2, 3, 1, 2, 4, 1, 2], [5, 5, 5, 5], [9, 8, 7, 9, 8, 7, 9, 8]]
    for i, ctx in enumerate(contexts):
        assert index.propose(f"r{i}", ctx, 3) == scan.propose(f"r{i}", ctx, 3)
    assert index.propose("r0", contexts[0], 3) == [3, 1, 2]  # the earliest "1 2", as vLLM
