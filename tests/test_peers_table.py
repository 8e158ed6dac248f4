"""benchmarks/peers/run_peers.py's repeat table: interleaved runs of the same server pair
by cycle, and a ratio whose interval holds 1 says so."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("run_peers",
                                                  ROOT / "benchmarks" / "peers" / "run_peers.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["run_peers"] = mod
    spec.loader.exec_module(mod)
    return mod


def _r(tput: float, session: float, cpu: float) -> dict:
    return {"total_token_throughput": tput, "median_session_time_s": session,
            "tokens_per_server_cpu_s": cpu}


def test_no_table_without_repeats() -> None:
    rp = _module()
    assert rp.repeat_table({"vllm": _r(1, 1, 1), "hlserve-throughput": _r(2, 2, 2)}) is None


def test_repeats_pair_by_cycle_and_flag_no_difference() -> None:
    rp = _module()
    res = {"vllm": _r(1000, 100, 500), "hlserve-throughput": _r(1500, 70, 700),
           "vllm#2": _r(1100, 95, 520), "hlserve-throughput#2": _r(1640, 66, 740),
           "vllm#3": _r(900, 105, 480), "hlserve-throughput#3": _r(1360, 74, 690)}
    table = rp.repeat_table(res)
    assert table is not None
    row = next(line for line in table.splitlines() if line.startswith("| hlserve-throughput"))
    assert "| 3 |" in row
    # the ratio moves with the cycle (paired), so its interval is tight and excludes 1
    assert "1.50x [" in row and "no difference" not in row.split("|")[6]
    noisy = {"vllm": _r(1000, 100, 500), "x": _r(1400, 100, 500),
             "vllm#2": _r(1000, 100, 500), "x#2": _r(700, 100, 500)}
    row = next(line for line in rp.repeat_table(noisy).splitlines() if line.startswith("| x "))
    assert "no difference" in row or "(n=" in row


def test_the_chat_workload_has_no_sessions_and_the_table_says_so() -> None:
    """Unique prompts (``--workload chat``) have no session times; the run's table once
    failed on them after every server had run, so no summary was written."""
    rp = _module()
    base = {"output_throughput": 27.0, "median_ttft_ms": 2349.0, "p99_ttft_ms": 16613.0,
            "median_tpot_ms": 244.0, "p99_tpot_ms": 379.0, "failed": 0,
            "median_session_time_s": None, "p90_session_time_s": None}
    res = {"vllm": base | {"total_token_throughput": 414.0, "tokens_per_server_cpu_s": 209.0,
                           "peak_rss_gib": 7.68},
           "hlserve-throughput": base | {"total_token_throughput": 406.0,
                                         "tokens_per_server_cpu_s": 225.0}}
    row = next(line for line in rp.table(res).splitlines()
               if line.startswith("| hlserve-throughput"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == "406" and cells[3] == "225" and cells[4] == "— / —"
    assert cells[7] == "—" and cells[9] == "0.98x" and cells[10] == "—"
