"""Speculative decoding in throughput mode on the real model (issue 24).

The in-process engine (no HTTP) in throughput mode on SmolLM2-135M-Instruct, closed-loop
sessions run to their end, each point once without speculation (``off``) and once with it
(``spec``: ``--speculative-config`` n-gram, k = 3, throughput mode's adaptive k; ``--method
suffix`` for SuffixDecoding; ``--fixed-k`` adds a third arm with k fixed), interleaved
A B B A over ``--repeats`` (repeat i of every arm on workload seed i), a fresh engine per run
on one loaded model (nothing cached from one run to the next). Workloads:

- ``agent``: hlserve's agent sessions (token ids; a shared system prompt, tool results, pinned
  outputs of ``--max-tokens``): little for a proposer to find;
- ``coding``: the coding pipeline (:mod:`hlserve.driver.coding_workload`): each round quotes a file
  of a shared repository and asks for it edited, in text through the chat template; the
  replies are the model's, up to ``--max-tokens``, and copy long spans of the prompt.

Per point (workload x sessions), mean and 95% interval over the repeats: tokens per engine
step (output tokens / steps), acceptance rate (accepted / draft tokens), mean accepted per
draft, total throughput (prompt + output tokens / wall seconds), and the paired ratio
spec / off with its interval (hlserve.driver.stats). The JSON also holds the acceptance profile by
position (P(draft token i accepted), i = 1..k) per workload and per point, the adaptive k's
steps by k, and whether both arms' outputs were identical (greedy: they must be).

    python benchmarks/speculation.py                        # the sweep: ~15 min on 2 cores
    python benchmarks/speculation.py --sessions 1 4 --rounds 1 --max-tokens 16   # smoke
    python benchmarks/speculation.py --method suffix --k 8 --out results/spec-suffix.json

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
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hlserve.driver.closed_loop import Loop, run_closed_loop
from hlserve.driver.coding_workload import CodingWorkload
from hlserve.driver.one_model import OneModel
from hlserve.driver.repeats import RepeatPlan, add_inprocess_args, machine_info, run_repeats
from hlserve.driver.stats import fmt_ci
from hlserve.driver.workloads import AgentWorkload
from hlserve.engine.args import parse_engine_args

WORKLOADS = ("agent", "coding")
RATIO_METRICS = ("tokens_per_step", "total_token_throughput", "output_throughput")


@dataclass(frozen=True)
class Bench:
    """What every run of the sweep shares."""

    model: str
    rounds: int = 2
    max_tokens: int = 64
    method: str = "ngram"
    k: int = 3
    fixed_k: bool = False
    engine: dict[str, Any] = field(default_factory=dict)  # --engine-args, parsed

    def speculative_config(self) -> dict[str, Any]:
        return {"method": self.method, "num_speculative_tokens": self.k}

    def arms(self) -> dict[str, dict[str, Any]]:
        """off first: it is the ratios' baseline (A in A B B A)."""
        spec = {"speculative_config": self.speculative_config()}
        arms: dict[str, dict[str, Any]] = {"off": {}, "spec": spec}
        if self.fixed_k:
            arms["spec-fixed"] = {**spec, "speculative_adaptive": False}
        return arms


class Runs:
    """One model load for the whole sweep: every run's engine is fresh (its own KV manager,
    prefix cache and statistics) on the same runner, whose KV tensors a new engine simply
    overwrites."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.model = OneModel(bench.model, {"mode": "throughput", **bench.engine})
        self.runner = self.model.runner

    def engine(self, arm: dict[str, Any]) -> Any:
        return self.model.engine(arm)

    def sessions(self, workload: str, n: int, seed: int, engine: Any) -> list[Any]:
        b = self.bench
        if workload == "coding":
            w = CodingWorkload(sessions=n, rounds=b.rounds, max_tokens=b.max_tokens, seed=seed)
            return w.sessions_list(engine.tokenizer)
        agent = AgentWorkload(sessions=n, rounds=b.rounds, system_prompt_len=256, task_len=32,
                              tool_output_len=(32, 96), output_len=b.max_tokens, seed=seed)
        return agent.sessions_list()

    def run(self, workload: str, n: int, arm: dict[str, Any], seed: int) -> dict[str, Any]:
        """One measured run: the metrics of one arm at one point on one seed."""
        engine = self.engine(arm)
        sessions = self.sessions(workload, n, seed, engine)
        outputs: dict[str, list[int] | None] = {}  # by request (finish order differs)
        steps0, before = engine.stats.steps, _spec_totals(engine)
        t0 = time.perf_counter()
        res = run_closed_loop(engine, sessions.__getitem__, n, Loop(),
                              on_record=lambda r, _p, out: outputs.__setitem__(r.request_id, out))
        wall = time.perf_counter() - t0
        if res.errors:
            raise RuntimeError(f"{res.errors} request(s) failed: "
                               f"{[r.error for r in res.records if r.error][:3]}")
        return _metrics(engine, res.records, wall, engine.stats.steps - steps0, before, outputs)


def _spec_totals(engine: Any) -> dict[str, Any]:
    """Speculation's running totals now (a run's are what grew during it)."""
    s = engine.spec_stats
    if s is None:
        return {}
    out = {"drafts": s.num_drafts, "draft_tokens": s.num_draft_tokens,
           "accepted_tokens": s.num_accepted_tokens, "per_pos": list(s.accepted_per_pos),
           "drafted_per_pos": list(s.drafted_per_pos), "lookups": s.num_lookups}
    if s.adaptive is not None:
        out.update(steps_by_k=list(s.adaptive.steps_by_k), probes=s.adaptive.probes)
    return out


def _grown(now: Any, before: Any) -> Any:
    if isinstance(now, list):
        return [a - b for a, b in zip(now, before, strict=True)]
    return now - before


def _metrics(engine: Any, records: list[Any], wall: float, steps: int,
             before: dict[str, Any], outputs: dict[str, list[int] | None]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in records)
    out = sum(r.output_tokens for r in records)
    m: dict[str, Any] = {
        "requests": len(records), "steps": steps, "prompt_tokens": prompt,
        "output_tokens": out, "cached_tokens": sum(r.cached_tokens or 0 for r in records),
        "wall_s": wall, "tokens_per_step": out / max(1, steps),
        "total_token_throughput": (prompt + out) / wall, "output_throughput": out / wall,
        # the arms of one repeat ran the same seed: greedy outputs must match
        "outputs_digest": hashlib.sha256(
            json.dumps(sorted(outputs.items())).encode()).hexdigest()[:16],
    }
    g = {key: _grown(now, before[key]) for key, now in _spec_totals(engine).items()}
    if not g:
        return m
    drafts, draft_tokens, accepted = g["drafts"], g["draft_tokens"], g["accepted_tokens"]
    m.update(drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
             acceptance_rate=accepted / draft_tokens if draft_tokens else None,
             accepted_per_draft=accepted / drafts if drafts else None,
             accepted_per_pos=g["per_pos"], drafted_per_pos=g["drafted_per_pos"],
             lookups=g["lookups"], propose_rate=drafts / g["lookups"] if g["lookups"] else None)
    for i, n in enumerate(g["per_pos"]):
        m[f"p_accept_pos{i + 1}"] = n / drafts if drafts else None
    if "steps_by_k" in g:
        m["adaptive_steps_by_k"], m["adaptive_probes"] = g["steps_by_k"], g["probes"]
    return m


# ---- the sweep ----------------------------------------------------------------------------


def run_point(runs: Runs, workload: str, sessions: int, repeats: int, seed: int,
              bar: tqdm) -> dict[str, Any]:
    """Every arm at one point, interleaved A B B A (driver/repeats.py), with intervals and the
    paired ratios against ``off``."""
    raw: dict[str, list[dict[str, Any]]] = {}

    def one(arm: dict[str, Any], s: int) -> dict[str, Any]:
        return runs.run(workload, sessions, arm, s)

    def done(r: Any, res: Any) -> None:
        bar.update(1)
        bar.set_postfix_str(f"{workload} x{sessions} {r.name} #{r.repeat}")
        if isinstance(res, dict):
            raw.setdefault(r.name, []).append({"repeat": r.repeat, **res})

    out = run_repeats(runs.bench.arms(), one, RepeatPlan(repeats, seed, warmup=0),
                      baseline="off", ratio_metrics=RATIO_METRICS, on_run=done)
    digests: dict[int, set[str]] = {}
    for rows in raw.values():
        for row in rows:
            digests.setdefault(row["repeat"], set()).add(row["outputs_digest"])
    same = all(len(d) == 1 for d in digests.values()) if digests else None
    return {"workload": workload, "sessions": sessions, **out, "same_outputs": same,
            "profile": {name: profile(rows) for name, rows in raw.items() if name != "off"},
            "runs": raw}


def profile(rows: list[dict[str, Any]]) -> list[float] | None:
    """P(draft token i accepted | the draft reached position i), i = 1..k, over every draft of
    these runs (a proposal may be shorter than k: the context's end, or the adaptive k)."""
    per_pos = [r["accepted_per_pos"] for r in rows if r.get("accepted_per_pos")]
    reached = [r["drafted_per_pos"] for r in rows if r.get("drafted_per_pos")]
    if not per_pos or not reached:
        return None
    k = len(per_pos[0])
    tried = [sum(d[i] for d in reached) for i in range(k)]
    return [sum(p[i] for p in per_pos) / tried[i] if tried[i] else 0.0 for i in range(k)]


def propose_rate(rows: list[dict[str, Any]]) -> float | None:
    """The share of lookups (a decoding request asked for a draft) that proposed one."""
    lookups = sum(r.get("lookups") or 0 for r in rows)
    return sum(r.get("drafts") or 0 for r in rows) / lookups if lookups else None


def _spec_rows(points: list[dict[str, Any]]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for p in points:
        for arm, rows in p["runs"].items():
            if arm != "off":
                out.setdefault(p["workload"], {}).setdefault(arm, []).extend(rows)
    return out


def workload_profiles(points: list[dict[str, Any]]) -> dict[str, dict[str, list[float] | None]]:
    """The acceptance profile of each workload and speculating arm, over all its points."""
    return {w: {arm: profile(rows) for arm, rows in arms.items()}
            for w, arms in _spec_rows(points).items()}


def sim_profiles(points: list[dict[str, Any]], arm: str = "spec") -> dict[str, Any]:
    """The ``spec`` arm's profile per workload in the form the simulator reads
    (``AcceptanceProfile.load``, ``benchmarks/study_speculation.py --profiles``): acceptance
    by position made non-increasing (a draft is accepted as a prefix), the match rate, and
    how far drafts reach (the share with a token at each position)."""
    out: dict[str, Any] = {}
    for w, arms in _spec_rows(points).items():
        rows = arms.get(arm, [])
        accept, rate = profile(rows), propose_rate(rows)
        if accept is None or rate is None:
            continue
        for i in range(1, len(accept)):
            accept[i] = min(accept[i], accept[i - 1])
        drafts = sum(r.get("drafts") or 0 for r in rows)
        reached = [r["drafted_per_pos"] for r in rows if r.get("drafted_per_pos")]
        reach = [sum(d[i] for d in reached) / drafts for i in range(len(accept))]
        out[w] = {"accept": accept, "propose_rate": rate, "reach": reach}
    return out


def table(points: list[dict[str, Any]]) -> str:
    """Markdown: each speculating arm against off, per point (mean ± 95% half-width)."""
    head = ("| workload | sessions | arm | tokens/step off | tokens/step spec | ratio | "
            "acceptance | accepted/draft | tok/s off | tok/s spec | ratio | same outputs |")
    rows = [head, "|" + "---|" * 12]
    for p in points:
        off = p["configs"]["off"]
        for arm, s in p["configs"].items():
            if arm == "off":
                continue
            r = p["ratios"].get(arm, {})

            def ci(summary: dict[str, Any], key: str, fmt: str) -> str:
                return fmt_ci(summary.get(key), summary.get(f"{key}_ci95"), fmt)

            rows.append(
                f"| {p['workload']} | {p['sessions']} | {arm} "
                f"| {ci(off, 'tokens_per_step', '{:.2f}')} | {ci(s, 'tokens_per_step', '{:.2f}')} "
                f"| {r.get('tokens_per_step', {}).get('text', '—')} "
                f"| {ci(s, 'acceptance_rate', '{:.2f}')} | {ci(s, 'accepted_per_draft', '{:.2f}')} "
                f"| {ci(off, 'total_token_throughput', '{:.0f}')} "
                f"| {ci(s, 'total_token_throughput', '{:.0f}')} "
                f"| {r.get('total_token_throughput', {}).get('text', '—')} "
                f"| {'yes' if p['same_outputs'] else 'no' if p['same_outputs'] is False else '—'} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    ap.add_argument("--sessions", nargs="+", type=int, default=[1, 4, 16, 64],
                    help="concurrent sessions per point (default: 1 4 16 64)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per session (default: 2)")
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="output tokens per round: agent pinned, coding at most (default: 64)")
    ap.add_argument("--method", choices=["ngram", "suffix"], default="ngram")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens (default: 3)")
    ap.add_argument("--fixed-k", action="store_true",
                    help="a third arm: k fixed every step (speculative_adaptive off)")
    add_inprocess_args(ap, Path("results/speculation.json"), "--kv-cache-gb 4 --dtype bfloat16")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench(args.model, args.rounds, args.max_tokens, args.method, args.k, args.fixed_k,
                  parse_engine_args(shlex.split(args.engine_args)))
    runs = Runs(bench)
    total = len(args.workloads) * len(args.sessions) * len(bench.arms()) * args.repeats
    points = []
    with tqdm(total=total, desc="runs", unit="run", disable=not args.progress) as bar:
        for workload in args.workloads:
            for n in args.sessions:
                points.append(run_point(runs, workload, n, args.repeats, args.seed, bar))
    result = {
        "command": "python " + shlex.join(["benchmarks/speculation.py", *sys.argv[1:]]),
        "bench": {**bench.__dict__, "arms": bench.arms()},
        "repeats": args.repeats, "seed": args.seed,
        "machine": machine_info(),
        "acceptance_profile": workload_profiles(points),
        "profiles": sim_profiles(points),  # what the simulated study reads
        "points": points,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(table(points))
    errors = {f"{p['workload']} x{p['sessions']}": p["errors"] for p in points if p["errors"]}
    if errors:
        print(f"failed runs: {errors}", file=sys.stderr)
    print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
