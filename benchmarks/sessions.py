"""Agent sessions with tool time on the real engine, its KV pool under pressure (issue 25, item 3):
does keeping a session's KV between its rounds, and admitting its next round first, finish
jobs sooner on this machine?

The in-process engine (no HTTP, the wall clock) in throughput mode on SmolLM2-135M-Instruct,
a fixed set of ``--sessions`` agent sessions run to their end (``--rounds`` each: every round's
prompt is the session's whole context so far plus a new tool result, so its next round can
reuse what the last one left in the pool), a lognormal tool call between a session's rounds
(``--tool-median`` seconds, ``--sigma`` its log's spread; slept on the wall clock while the
engine steps the other sessions), and a KV pool of ``--num-pages`` pages: smaller than the
sessions' contexts together (``working_set_pages`` in the JSON), so pages are evicted. The
four arms of ``benchmarks/study_sessions.py`` (the simulated study), each on top of
throughput mode:

- ``hold+program``: ``retain+program`` with ``--session-hold on`` (a new session's first
  round does not evict retained pages while other requests run: Continuum's pinning);
- ``retain+program``: ``--session-ttl`` = ``--ttl-factor`` x the median tool time (the fixed
  policy; ``--ttl-policy learned``) and ``--order program``;
- ``lpm``: no retention, throughput mode's own order (longest prefix match): the baseline;
- ``fcfs``: no retention, first come first served.

Interleaved A B C D D C B A over ``--repeats`` (repeat i of every arm on workload seed
``--seed + i``), a fresh engine per run on one loaded model (nothing cached from one run to
the next). Per arm, mean and 95% interval over the repeats: session completion p50 / p90 /
p99 (a session's first round sent to its last round done, tool calls included), total token
throughput ((prompt + output tokens) / wall seconds), prompt tokens computed and re-prefilled
context (tokens of a session's previous round that its next round found evicted and computed
again); each arm's throughput and p50 completion against ``lpm`` as paired ratios with their
Fieller intervals (hlserve.driver.stats). The JSON also holds, per run, the pool's pressure: pages
evicted, retractions, the retention counters (TTL hits, expiries, retained pages evicted
under pressure, the engine's own re-prefilled count of retained context), and whether the
arms' greedy outputs were identical (outputs are pinned in length; a token that differs
changes the session's later prompts).

    python benchmarks/sessions.py                  # 4 arms x 2 repeats: ~15-20 min on 2 cores
    python benchmarks/sessions.py --ttl-policy learned --out results/sessions-learned.json
    python benchmarks/sessions.py --sessions 4 --rounds 2 --num-pages 64 --repeats 1  # smoke

With a fixed TTL and every request a session's round, retention keeps nearly LRU's eviction
order: deadlines come in the order pages were released, so the pages that expire (and go
first) are those LRU would evict first. ``retain+program`` then differs from ``lpm`` mostly
by its order; ``--ttl-policy learned`` gives each session a TTL of its own (or none), which
does change what is evicted.

Timed numbers need the machine to itself; a shared machine gives intervals of noise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hlserve.driver.closed_loop import Loop, run_closed_loop
from hlserve.driver.one_model import OneModel
from hlserve.driver.records import session_completion
from hlserve.driver.repeats import RepeatPlan, add_inprocess_args, machine_info, run_repeats
from hlserve.driver.session_arms import SESSION_ARMS, session_arm_options
from hlserve.driver.stats import fmt_ci
from hlserve.driver.tool_time import parse_tool_time
from hlserve.driver.workloads import AgentWorkload, Dist
from hlserve.engine.args import parse_engine_args

ARMS = SESSION_ARMS
BASELINE = "lpm"
RATIO_METRICS = ("total_token_throughput", "session_completion_p50_s")


@dataclass(frozen=True)
class Bench:
    """What every run shares: the model, the workload's shape, the pool, the arms."""

    model: str
    sessions: int = 16
    rounds: int = 5
    system_prompt_len: int = 256
    task_len: int = 64
    tool_output_len: tuple[int, int] = (64, 192)
    max_tokens: int = 32
    tool_median: float = 2.0
    sigma: float = 1.0
    ttl_factor: float = 3.0
    ttl_policy: str = "fixed"
    num_pages: int = 448
    arm_names: tuple[str, ...] = ARMS
    engine: dict[str, Any] = field(default_factory=dict)  # --engine-args, parsed

    @property
    def tool_time(self) -> str:
        """The tool time's spec (hlserve/driver/tool_time.py): lognormal, or fixed with sigma 0."""
        if self.sigma == 0:
            return f"fixed:{self.tool_median:g}"
        return f"lognormal:{self.tool_median:g}:{self.sigma:g}"

    def arms(self) -> dict[str, dict[str, Any]]:
        return {a: session_arm_options(a, self.tool_median, self.ttl_factor, self.ttl_policy)
                for a in self.arm_names}

    def workload(self, seed: int) -> AgentWorkload:
        lo, hi = self.tool_output_len
        return AgentWorkload(sessions=self.sessions, rounds=self.rounds,
                             system_prompt_len=self.system_prompt_len, task_len=self.task_len,
                             tool_output_len=Dist.uniform(lo, hi),
                             output_len=Dist.constant(self.max_tokens), seed=seed,
                             tool_time=parse_tool_time(self.tool_time))


class Runs:
    """One model load for the whole bench: every run's engine is fresh (its own KV manager,
    prefix cache, sessions and statistics) on the same runner, whose KV tensors a new engine
    simply overwrites. The pool is ``num_pages`` pages in every arm."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.model = OneModel(bench.model, {"mode": "throughput", **bench.engine, "num_pages": bench.num_pages})
        self.runner = self.model.runner

    def engine(self, arm: dict[str, Any]) -> Any:
        return self.model.engine(arm)

    def run(self, arm: dict[str, Any], seed: int) -> dict[str, Any]:
        """One measured run: every session of workload ``seed`` to its end, under ``arm``."""
        engine = self.engine(arm)
        workload = self.bench.workload(seed)
        outputs: dict[str, list[int] | None] = {}  # by request (finish order differs)
        before = _counters(engine)
        t0 = time.perf_counter()
        res = run_closed_loop(engine, workload.make_session, workload.sessions, Loop(),
                              on_record=lambda r, _p, out: outputs.__setitem__(r.request_id, out))
        wall = time.perf_counter() - t0
        if res.errors:
            raise RuntimeError(f"{res.errors} request(s) failed: "
                               f"{[r.error for r in res.records if r.error][:3]}")
        grown = {k: v - before[k] for k, v in _counters(engine).items()}
        pages = (engine.kv.page_size, self.bench.system_prompt_len)
        return _metrics(res, wall, pages, grown, outputs)


def _counters(engine: Any) -> dict[str, int]:
    """The engine's running totals now (a run's are what grew during it)."""
    kv, s = engine.kv, engine.sessions.stats
    return {"steps": engine.stats.steps, "computed_tokens": engine.stats.computed_tokens,
            "retractions": engine.num_retractions, "evicted_pages": kv.num_evicted,
            "prefix_cache_hits": engine.prefix_cache_hits, "ttl_hits": kv.retained_hits,
            "ttl_expiries": kv.retained_expired, "retained_evicted": kv.retained_evicted,
            "engine_reprefilled_tokens": s.reprefilled_tokens, "retained_rounds": s.rounds}


def reprefill(records: list[Any], page_size: int, shared_tokens: int) -> tuple[int, int]:
    """(re-prefilled context tokens, working-set pages) from a run's records.

    A round's prompt begins with its session's previous round: that round's prompt and
    output, whose KV was computed but for the last output token, in full pages reusable by
    the prefix cache. What of that the round found not cached it computed again, in every
    arm alike (the engine's own count covers retained context only). The working set: the
    full pages of every session's last context together, the system prompt's
    (``shared_tokens``) once. A pool smaller than that evicted pages: the prefix tree would
    otherwise hold every one of them at the end."""
    by_session: dict[int, list[Any]] = {}
    for r in records:
        by_session.setdefault(r.session_id, []).append(r)
    again, pages = 0, 0
    for rows in by_session.values():
        rows.sort(key=lambda r: r.round)
        for prev, cur in pairwise(rows):
            reusable = (prev.prompt_tokens + prev.output_tokens - 1) // page_size * page_size
            again += max(0, reusable - (cur.cached_tokens or 0))
        last = rows[-1]
        pages += (last.prompt_tokens + last.output_tokens - 1) // page_size
    shared = shared_tokens // page_size * max(0, len(by_session) - 1)
    return again, pages - shared


def _metrics(res: Any, wall: float, pages: tuple[int, int], grown: dict[str, int],
             outputs: dict[str, list[int] | None]) -> dict[str, Any]:
    records = res.records
    prompt = sum(r.prompt_tokens for r in records)
    out = sum(r.output_tokens for r in records)
    cached = sum(r.cached_tokens or 0 for r in records)
    again, working_set = reprefill(records, *pages)
    times = res.session_times
    return {
        "requests": len(records), "sessions_completed": len(times), "prompt_tokens": prompt,
        "output_tokens": out, "cached_tokens": cached, "prefilled_tokens": prompt - cached,
        "reprefilled_tokens": again, "working_set_pages": working_set, "wall_s": wall,
        "total_token_throughput": (prompt + out) / wall, "output_throughput": out / wall,
        **session_completion(times),
        "session_completion_mean_s": sum(times) / len(times) if times else None,
        **grown,
        # the arms of one repeat ran the same seed: greedy outputs should match
        "outputs_digest": hashlib.sha256(
            json.dumps(sorted(outputs.items())).encode()).hexdigest()[:16],
    }


# ---- the bench ----------------------------------------------------------------------------


def run_arms(runs: Runs, repeats: int, seed: int, bar: tqdm) -> dict[str, Any]:
    """Every arm, interleaved A B C C B A (driver/repeats.py), with intervals and the paired
    ratios against ``lpm``; whether each repeat's arms gave identical outputs."""
    raw: dict[str, list[dict[str, Any]]] = {}

    def done(r: Any, res: Any) -> None:
        bar.update(1)
        bar.set_postfix_str(f"{r.name} #{r.repeat}")
        if isinstance(res, dict):
            raw.setdefault(r.name, []).append({"repeat": r.repeat, **res})

    arms = runs.bench.arms()
    out = run_repeats(arms, runs.run, RepeatPlan(repeats, seed, warmup=0),
                      baseline=BASELINE if BASELINE in arms else None,
                      ratio_metrics=RATIO_METRICS, on_run=done)
    digests: dict[int, set[str]] = {}
    for rows in raw.values():
        for row in rows:
            digests.setdefault(row["repeat"], set()).add(row["outputs_digest"])
    same = all(len(d) == 1 for d in digests.values()) if digests else None
    return {**out, "same_outputs": same, "runs": raw}


def table(result: dict[str, Any]) -> str:
    """Markdown: each arm's completion, throughput and pressure (mean ± 95% half-width), and
    its throughput and p50 completion against the baseline's (paired ratios)."""
    base = next((r["vs"] for r in result["ratios"].values()), BASELINE)
    head = (f"| arm | completion p50 (s) | p90 (s) | p99 (s) | tok/s | tok/s vs {base} "
            f"| p50 vs {base} | prefilled tokens | re-prefilled | evicted pages | TTL hits "
            "| TTL expiries | retained evicted | retractions |")
    rows = [head, "|---|" + "---:|" * 4 + "---|---|" + "---:|" * 7]
    for arm, s in result["configs"].items():
        r = result["ratios"].get(arm, {})

        def ci(key: str, fmt: str = "{:.0f}", s: dict[str, Any] = s) -> str:
            return fmt_ci(s.get(key), s.get(f"{key}_ci95"), fmt)

        def vs(key: str, r: dict[str, Any] = r) -> str:
            return r.get(key, {}).get("text", "—")

        rows.append(
            f"| {arm} | {ci('session_completion_p50_s', '{:.1f}')} "
            f"| {ci('session_completion_p90_s', '{:.1f}')} "
            f"| {ci('session_completion_p99_s', '{:.1f}')} | {ci('total_token_throughput')} "
            f"| {vs('total_token_throughput')} | {vs('session_completion_p50_s')} "
            f"| {ci('prefilled_tokens')} | {ci('reprefilled_tokens')} | {ci('evicted_pages')} "
            f"| {ci('ttl_hits')} | {ci('ttl_expiries')} | {ci('retained_evicted')} "
            f"| {ci('retractions')} |")
    same, b = result["same_outputs"], result["bench"]
    sets = sorted({row["working_set_pages"] for runs in result["runs"].values() for row in runs})
    span = "—" if not sets else f"{sets[0]}" if len(sets) == 1 else f"{sets[0]}-{sets[-1]}"
    rows.append(f"\nKV pool {b['num_pages']} pages of {b['page_size']} tokens; the sessions' "
                f"working set {span} pages; same greedy outputs in every arm: "
                f"{'yes' if same else 'no' if same is False else '—'}")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sessions", type=int, default=16, help="sessions (default: 16)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per session (default: 5)")
    ap.add_argument("--system-prompt", type=int, default=256,
                    help="shared system prompt tokens (default: 256)")
    ap.add_argument("--task", type=int, default=64, help="a session's own first tokens (64)")
    ap.add_argument("--tool-output", type=int, nargs=2, default=[64, 192], metavar=("LO", "HI"),
                    help="tool result tokens appended per round, uniform (default: 64 192)")
    ap.add_argument("--max-tokens", type=int, default=32,
                    help="output tokens per round, pinned (default: 32)")
    ap.add_argument("--tool-median", type=float, default=2.0,
                    help="median tool time between rounds, seconds (default: 2)")
    ap.add_argument("--sigma", type=float, default=1.0,
                    help="the lognormal tool time's log spread; 0: fixed (default: 1)")
    ap.add_argument("--ttl-factor", type=float, default=3.0,
                    help="retain+program: --session-ttl = this x the median tool time")
    ap.add_argument("--ttl-policy", choices=["fixed", "learned"], default="fixed")
    ap.add_argument("--num-pages", type=int, default=448,
                    help="KV pool pages (of --page-size tokens, 16 by default): about half the "
                         "default sessions' working set, so it is under pressure (default: 448)")
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    add_inprocess_args(ap, Path("results/sessions.json"), "--dtype bfloat16")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench(args.model, args.sessions, args.rounds, args.system_prompt, args.task,
                  tuple(args.tool_output), args.max_tokens, args.tool_median, args.sigma,
                  args.ttl_factor, args.ttl_policy, args.num_pages, tuple(args.arms),
                  parse_engine_args(shlex.split(args.engine_args)))
    runs = Runs(bench)
    with tqdm(total=len(bench.arm_names) * args.repeats, desc="runs", unit="run",
              disable=not args.progress) as bar:
        out = run_arms(runs, args.repeats, args.seed, bar)
    result = {
        "command": "python " + shlex.join(["benchmarks/sessions.py", *sys.argv[1:]]),
        "bench": {**bench.__dict__, "tool_time": bench.tool_time, "arms": bench.arms(),
                  "page_size": runs.runner.page_size},
        "repeats": args.repeats, "seed": args.seed,
        "machine": machine_info(),
        **out,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(table(result))
    if out["errors"]:
        print(f"failed runs: {out['errors']}", file=sys.stderr)
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
