"""``hlserve sweep`` on the tiny model: in-process points, and a real ``hlserve serve``
started, benchmarked and torn down per point from a command template."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from hlserve.bench.serve_bench import BenchSpec
from hlserve.bench.sweep import SweepSpec, make_points, run_sweep
from hlserve.server.runtime.launch import ExternalServer, port_free

WORKLOAD = dict(workload="agent", sessions=3, rounds=2, system_prompt_len=64, task_len=16,
                tool_output_len=(16, 48), output_len=(4, 8), progress=False, timeout=120)


def check_outputs(out: Path, labels: list[str]) -> dict:
    summary = json.loads((out / "sweep.json").read_text())
    assert [p["label"] for p in summary["points"]] == labels
    for p in summary["points"]:
        r = p["metrics"]
        assert r["completed"] == 6 and r["failed"] == 0, r.get("error") or r.get("errors")
        assert r["sessions_completed"] == 3
        assert (out / "points" / f"{p['label']}.json").exists()
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tax = (out / "tax.md").read_text()
    assert "human tax" in tax and "| none | none |" in tax
    assert summary["tax"][-1]["human_tax"] == 0  # no target: the best point, no tax
    return summary


def test_in_process_sweep(tiny_llama: Path, tmp_path: Path) -> None:
    points = make_points([32, None], "same", ["throughput=--mode throughput"])
    sw = SweepSpec(model=str(tiny_llama), points=points,
                   bench=BenchSpec(base_url="", **WORKLOAD), out_dir=tmp_path,
                   engine_args=["--preset", "vllm", "--dtype", "float32", "--max-model-len",
                                "512", "--num-pages", "128"], command="test")
    run_sweep(sw, log=lambda *a: None)
    summary = check_outputs(tmp_path, ["C=32", "C=none", "throughput"])
    res = {p["label"]: p["metrics"] for p in summary["points"]}
    assert res["C=32"]["engine_config"]["chunk_size"] == 32
    assert res["C=32"]["engine_config"]["token_budget"] == 32
    assert res["C=32"]["engine_config"]["mixing"] == "always"  # the base preset (vllm)
    assert "chunk_size                 32" in res["C=32"]["engine_caps"]
    assert res["C=none"]["engine_config"]["chunk_size"] is None
    assert res["C=none"]["engine_config"]["token_budget"] is None
    assert res["throughput"]["engine_config"]["preset"] == "hlserve"  # its own preset won
    assert res["throughput"]["engine_config"]["mixing"] == "two_stage"
    assert res["C=32"]["clock"] == "wall"


def test_server_sweep_starts_and_stops_a_server_per_point(tiny_llama: Path,
                                                          tmp_path: Path) -> None:
    template = (f"{shlex.quote(sys.executable)} -m hlserve.cli serve {{model}} --host {{host}} "
                "--port {port} --dtype float32 --max-model-len 512 --num-pages 128 "
                "--chunk-size {chunk_size} --max-num-batched-tokens {token_budget} "
                "--uvicorn-log-level warning {args}")
    sw = SweepSpec(model=str(tiny_llama), points=make_points([32, None]),
                   bench=BenchSpec(base_url="", **WORKLOAD), out_dir=tmp_path,
                   server_cmd=template, health_timeout=120,
                   command="test")
    run_sweep(sw, log=lambda *a: None)
    summary = check_outputs(tmp_path, ["C=32", "C=none"])
    for p in summary["points"]:
        cmd = p["metrics"]["server_command"]
        # no cap reaches the server as the word none, which hlserve serve reads as None
        assert "--chunk-size 32" in cmd if p["label"] == "C=32" else "--chunk-size none" in cmd
        log = Path(p["metrics"]["server_log"]).read_text()
        assert "hlserve engine caps" in log and "Traceback" not in log
        if p["label"] == "C=none":
            assert "chunk_size                 off" in log  # the engine got None
        port = int(cmd.split("--port ")[1].split()[0])
        assert port_free("127.0.0.1", port)  # torn down before the next point


def test_a_server_that_never_answers_is_reported(tmp_path: Path) -> None:
    code = "import sys; print('no such model', flush=True); sys.exit(3)"
    srv = ExternalServer([sys.executable, "-c", code], "127.0.0.1", 1, tmp_path / "log",
                         health_timeout=30)
    with pytest.raises(RuntimeError, match=r"(?s)exited with 3.*no such model"):
        srv.start()
    assert srv.proc.poll() == 3


def test_simulated_sweep(tmp_path: Path) -> None:
    pytest.importorskip("hlserve.sim.build")
    sw = SweepSpec(model="Qwen2.5-7B", points=make_points([512, None]), sim="H20",
                   bench=BenchSpec(base_url="", **WORKLOAD), out_dir=tmp_path, command="test")
    run_sweep(sw, log=lambda *a: None)
    summary = check_outputs(tmp_path, ["C=512", "C=none"])
    for p in summary["points"]:
        assert p["metrics"]["clock"] == "virtual"
        assert p["metrics"]["engine_config"]["chunk_size"] == p["knobs"]["chunk_size"]


def _point(label: str, ttft: float, tpot: float, tput: float, half: float | None) -> dict:
    r = {"completed": 10, "failed": 0, "p99_ttft_ms": ttft, "p99_tpot_ms": tpot,
         "total_token_throughput": tput}
    if half is not None:
        for k in ("p99_ttft_ms", "p99_tpot_ms", "total_token_throughput"):
            r[f"{k}_ci95"] = [r[k] - half, r[k] + half]
    return {"label": label, "knobs": {}, "metrics": r}


def test_frontier_plot_draws_intervals_and_readable_axes(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeated points carry their 95% intervals as error bars; a latency range under 3x gets
    a linear axis with ticks (a log axis over 17-19 s showed none)."""
    import matplotlib.pyplot as plt

    from hlserve.bench import report

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    narrow = [_point("a", 17_000, 400, 1200, 50), _point("b", 19_000, 450, 1250, 40),
              _point("c", 18_000, 430, 1100, None)]
    png = report.frontier_plot(narrow, tmp_path / "f.png")
    assert png.stat().st_size > 10_000
    ttft_ax = figs[0].axes[0]
    assert ttft_ax.get_xscale() == "linear"
    labels = [t.get_text() for t in ttft_ax.get_xticklabels() if t.get_text()]
    assert len(labels) >= 3
    bars = [c for c in ttft_ax.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(bars) == 2  # the two repeated points, not the single run
    wide = [_point("a", 500, 100, 1200, 10), _point("b", 20_000, 450, 1250, 10)]
    report.frontier_plot(wide, tmp_path / "g.png")
    assert figs[1].axes[0].get_xscale() == "log"
