"""Per-token cost of constrained decoding against unconstrained, on the 0.5B shape.

The same batch of prompts is generated with no constraint and with each constraint (a JSON
object grammar, a JSON schema, a regex), in alternating order, ``--repeats`` times. A run's
figure is its median decode step over the batch size (seconds per token); the table gives
the median [min-max] over repeats and the ratio to the unconstrained run of the same repeat.
The constraints are unbounded (``json_object``, a long regex, open strings) so that the
batch stays whole.

    python benchmarks/structured_cost.py [--model DIR] [--batch 4] [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hlserve.llm import LLM
from hlserve.models.tiny import make_tiny_model
from hlserve.request import SamplingParams
from hlserve.structured import StructuredOutputsParams
from hlserve.structured.grammar import apply_grammar_masks

SCHEMA = {"type": "object", "properties": {
    "notes": {"type": "array", "items": {"type": "object", "properties": {
        "title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "tags"]}}}, "required": ["notes"]}
CONSTRAINTS: dict[str, StructuredOutputsParams | None] = {
    "none": None,
    "json_object": StructuredOutputsParams(json_object=True),
    "json_schema": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"([a-z]+ ){1,400}"),
}


def run(llm: LLM, spec: StructuredOutputsParams | None, batch: int, tokens: int) -> float:
    """Median seconds per token of the decode steps with the whole batch running (the
    prefill step and steps after any request ended are left out, so a constraint that
    ends early is not charged for a smaller batch)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=1.0, seed=7,
                            ignore_eos=spec is None, structured_outputs=spec)
    for i in range(batch):
        eng.add_request(f"Write note {i} about the weather and the schedule:", params)
    steps: list[float] = []
    first, whole = True, True
    while eng.has_unfinished():
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        if not first and whole and len(outs) == batch:
            steps.append(dt / batch)
        first = False
        whole = whole and not any(o.finished for o in outs)
    return statistics.median(steps) if steps else float("nan")


class _Row:
    """What apply_grammar_masks reads of a request: its grammar and output so far."""

    def __init__(self, grammar: object) -> None:
        self.grammar = grammar
        self.output_token_ids: list[int] = []


def mask_cost(llm: LLM, spec: StructuredOutputsParams, batch: int, steps: int,
              dtype: torch.dtype) -> float:
    """Median seconds per token of the sampler's constrained work alone (fill the batch's
    masks, apply them to its logits), along paths the grammar accepts: what a constraint
    adds to a step, short enough that other load on the machine hardly lands in it."""
    vocab = llm.engine.runner.model_config.vocab_size
    rows = [_Row(llm.engine.grammars.state(spec)) for _ in range(batch)]
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen).to(dtype)
        t0 = time.perf_counter()
        apply_grammar_masks(logits, rows)
        times.append((time.perf_counter() - t0) / batch)
        for r, tok in zip(rows, logits.argmax(dim=-1).tolist(), strict=True):
            r.output_token_ids.append(tok)
            if r.grammar.advance(tok):  # complete: start over
                r.grammar = llm.engine.grammars.state(spec)
                r.output_token_ids = []
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the 0.5B shape, made here)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny_model(Path(tmp) / "m", arch="qwen2", size="0.5b",
                                                  dtype=args.dtype))
        llm = LLM(model, dtype=args.dtype)
        for spec in CONSTRAINTS.values():  # warm-up: compile, first-use index, allocator
            run(llm, spec, args.batch, 4)
        per_token: dict[str, list[float]] = {k: [] for k in CONSTRAINTS}
        for r in range(args.repeats):
            names = list(CONSTRAINTS) if r % 2 == 0 else list(reversed(CONSTRAINTS))
            for name in names:
                per_token[name].append(run(llm, CONSTRAINTS[name], args.batch, args.tokens))
        masks = {name: mask_cost(llm, spec, args.batch, 200, llm.engine.runner.dtype)
                 for name, spec in CONSTRAINTS.items() if spec is not None}
    base = per_token["none"]
    print(f"0.5B shape ({args.dtype}), batch {args.batch}, {args.tokens} tokens each, "
          f"{args.repeats} repeats: ms per token of a decode step, median [min-max]; ratio "
          "to none")
    for name, xs in per_token.items():
        ratios = [x / b for x, b in zip(xs, base, strict=True)]
        print(f"  {name:12s} {statistics.median(xs) * 1e3:8.2f} [{min(xs) * 1e3:.2f}-"
              f"{max(xs) * 1e3:.2f}]   x{statistics.median(ratios):.3f} "
              f"[{min(ratios):.3f}-{max(ratios):.3f}]")
    none = statistics.median(base)
    print("the constrained work alone (mask fill + apply, median of 200 steps), ms per "
          "token, and what it adds to the unconstrained step:")
    for name, m in masks.items():
        print(f"  {name:12s} {m * 1e3:8.3f}   +{m / none * 100:.2f}%")


if __name__ == "__main__":
    main()
