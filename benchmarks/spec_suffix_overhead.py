"""Suffix speculation on a workload with no reuse: is a run with it slower than without?

Two engines on the tiny random-weight Llama (built here, nothing downloaded), one without
speculation (``off``) and one with ``{"method": "suffix", "num_speculative_tokens": 3}``
(fixed k, so a lookup runs every step; ``--adaptive``: k chosen per step), take the same batches of random prompts, sampled
(temperature 1: the random weights give near-random tokens, so little repeats and few drafts
are accepted; finished outputs fill the suffix index as the run goes on). Batches alternate
A B B A; each pair gives a ratio suffix / off of the wall time and of the scheduler's time per
step (``Scheduler.schedule()``, where drafts are asked for). Printed: the mean ratio with a
95% t interval over the pairs.

    python benchmarks/spec_suffix_overhead.py                 # ~1-2 minutes on 2 cores
    python benchmarks/spec_suffix_overhead.py --requests 16 --tokens 96 --pairs 4
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from scipy.stats import t as student_t

from hlserve import LLM, SamplingParams
from hlserve.models.tiny import make_tiny_model

SPEC = {"method": "suffix", "num_speculative_tokens": 3}


def timed_llm(path: Path, spec: dict[str, Any] | None, adaptive: bool = False
              ) -> tuple[LLM, list[float]]:
    """An engine whose scheduler passes are timed into the returned list."""
    extra: dict[str, Any] = {"speculative_config": spec, "speculative_adaptive": adaptive} \
        if spec else {}
    llm = LLM(str(path), dtype="float32", **extra)
    sched, times = llm.engine.scheduler, []
    inner = sched.schedule

    def schedule() -> Any:
        t0 = time.perf_counter()
        out = inner()
        times.append(time.perf_counter() - t0)
        return out

    sched.schedule = schedule  # type: ignore[method-assign]
    return llm, times


def run(llm: LLM, times: list[float], prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """Wall seconds of one batch and mean scheduler milliseconds per step."""
    times.clear()
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=7)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, 1e3 * statistics.fmean(times)


def interval(ratios: list[float]) -> str:
    mean = statistics.fmean(ratios)
    if len(ratios) < 2:
        return f"{mean:.3f}"
    half = student_t.ppf(0.975, len(ratios) - 1) * statistics.stdev(ratios) / len(ratios) ** 0.5
    return f"{mean:.3f} [{mean - half:.3f}, {mean + half:.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24, help="requests per batch")
    ap.add_argument("--tokens", type=int, default=128, help="sampled tokens per request")
    ap.add_argument("--pairs", type=int, default=3, help="A B B A cycles (two pairs each)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--adaptive", action="store_true",
                    help="k chosen per step (--speculative-adaptive on, throughput mode's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "llama", arch="llama", size="tiny", seed=1)
        arms = {"off": timed_llm(path, None), "suffix": timed_llm(path, SPEC, args.adaptive)}
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        wall: dict[str, list[float]] = {"off": [], "suffix": []}
        sched: dict[str, list[float]] = {"off": [], "suffix": []}
        for _ in range(args.pairs):
            prompts = [[rng.randrange(3, vocab) for _ in range(16)]
                       for _ in range(args.requests)]
            for arm in ("off", "suffix", "suffix", "off"):
                w, s = run(*arms[arm], prompts, args.tokens)
                wall[arm].append(w)
                sched[arm].append(s)
                print(f"{arm:6s} wall {w:6.2f} s  schedule {s:6.3f} ms/step", flush=True)
        stats = arms["suffix"][0].engine.spec_stats
        pairs = len(wall["off"])
        print(f"\n{args.requests} requests x {args.tokens} tokens, {pairs} pairs "
              f"(A B B A x {args.pairs})")
        print("wall ratio suffix/off:     "
              + interval([wall["suffix"][i] / wall["off"][i] for i in range(pairs)]))
        print("schedule ms/step off:      " + interval(sched["off"]))
        print("schedule ms/step suffix:   " + interval(sched["suffix"]))
        if stats is not None:
            print(f"drafts {stats.num_drafts} of {stats.num_lookups} lookups, "
                  f"{stats.num_draft_tokens} draft tokens, {stats.num_accepted_tokens} accepted")


if __name__ == "__main__":
    main()
