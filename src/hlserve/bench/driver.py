"""In-process agent sessions run to the end (the closed loop of :mod:`hlserve.driver`), and
side-by-side comparisons of engine configurations (``hlserve demo``, ``benchmarks/modes.py``)."""

from __future__ import annotations

from hlserve.driver.closed_loop import run_agent_sessions
from hlserve.workloads import AgentWorkload

__all__ = ["compare_configs", "format_comparison", "run_agent_sessions"]


def compare_configs(
    model: str,
    configs: dict[str, dict[str, object]],
    workload: AgentWorkload,
    progress: bool = True,
    **common: object,
) -> dict[str, dict[str, float]]:
    """Run the same closed-loop workload under each named engine configuration, one after
    the other in this process, and return each run's summary."""
    from hlserve.llm import build_engine

    results = {}
    for name, options in configs.items():
        engine = build_engine(model, **{**common, **options})
        summary = run_agent_sessions(engine, workload, progress=progress).summary()
        summary["retractions"] = engine.num_retractions
        summary["iterations"] = engine.stats.steps
        results[name] = summary
    return results


def format_comparison(results: dict[str, dict[str, float]], baseline: str) -> str:
    """A side-by-side table; throughput ratios are against ``baseline``."""
    base = results[baseline]["total_token_throughput"]
    head = (f"{'config':<18}{'tok/s':>9}{'ratio':>7}{'out tok/s':>10}{'session p50/p99 s':>19}"
            f"{'TTFT p50/p99 ms':>18}{'TPOT p50/p99 ms':>18}{'retract':>8}")
    rows = [head]
    for name, s in results.items():
        rows.append(
            f"{name:<18}{s['total_token_throughput']:>9.0f}"
            f"{s['total_token_throughput'] / base:>7.2f}{s['output_throughput']:>10.1f}"
            f"{s['median_session_time_s']:>10.1f}/{s['p99_session_time_s']:<8.1f}"
            f"{s['median_ttft_ms']:>9.0f}/{s['p99_ttft_ms']:<8.0f}"
            f"{s['median_tpot_ms']:>9.0f}/{s['p99_tpot_ms']:<8.0f}{s['retractions']:>8.0f}"
        )
    return "\n".join(rows)
