"""xgrammar against llguidance on this machine: grammar compile time and per-token mask time.

How the grammar engine was chosen (docs/bench_results.md, "Structured outputs"). Both engines get
the project's own tokenizer with the 0.5B shape's vocabulary (151936 logits, as
Qwen2.5-0.5B), the same JSON schemas, a regex and free JSON, and walk the same kind of path:
at each step the engine fills the token bitmask, the mask is applied to random logits, the
argmax is accepted. Compile time is cold (a fresh compiler, nothing cached).

    python benchmarks/grammar_engines.py [--steps 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hlserve.models.tiny import SIZES, make_tiny_model

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer"}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
            "required": ["id", "tags"], "additionalProperties": False},
        "score": {"type": "number"}}, "required": ["user", "score"],
        "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "kind": {"enum": ["x", "y"]}}, "required": ["date", "kind"],
        "additionalProperties": False},
}
REGEX = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"


def tokenizer_dir(root: Path) -> Path:
    """A tiny model's directory: only its tokenizer is used (the same as the 0.5B shape's)."""
    return make_tiny_model(root / "m", arch="qwen2", size="tiny", seed=0)


def eos_ids(model_dir: Path) -> list[int]:
    gen = json.loads((model_dir / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    return eos if isinstance(eos, list) else [eos]


class XGrammar:
    name = "xgrammar"

    def __init__(self, model_dir: Path, vocab: int) -> None:
        import xgrammar as xgr

        from hlserve.tokenizer import Tokenizer

        self.xgr = xgr
        tok = Tokenizer.from_dir(model_dir)
        assert tok is not None
        raw = json.loads((model_dir / "tokenizer.json").read_text())
        specials = {t["id"] for t in raw["added_tokens"] if t["special"]}
        encoded = [""] * tok.vocab_size
        for text, i in raw["model"]["vocab"].items():
            encoded[i] = "" if i in specials else text
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab,
                                      stop_token_ids=eos_ids(model_dir))
        self.vocab = vocab

    def compile(self, kind: str, spec: str) -> Any:
        c = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json":
            return c.compile_json_schema(spec) if spec else c.compile_builtin_json_grammar()
        return c.compile_regex(spec)

    def walk(self, compiled: Any, steps: int, gen: torch.Generator) -> tuple[float, float]:
        xgr = self.xgr
        m = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, self.vocab)
        t_mask = t_apply = 0.0
        for _ in range(steps):
            logits = torch.randn(1, self.vocab, generator=gen)
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            t1 = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, mask)
            t_mask, t_apply = t_mask + t1 - t0, t_apply + time.perf_counter() - t1
            m.accept_token(int(logits.argmax()))
            if m.is_terminated():
                m.reset()
        return t_mask / steps, t_apply / steps


class LLGuidance:
    name = "llguidance"

    def __init__(self, model_dir: Path, vocab: int) -> None:
        import llguidance
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        text = (model_dir / "tokenizer.json").read_text()
        self.tok = llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos_ids(model_dir))
        self.vocab = vocab

    def compile(self, kind: str, spec: str) -> Any:
        m = self.llg.LLMatcher
        grammar = (m.grammar_from_json_schema(spec or '{"type": "object"}') if kind == "json"
                   else m.grammar_from_regex(spec))
        matcher = m(self.tok, grammar)  # validates and builds the parser (its lexer is lazy)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def walk(self, compiled: Any, steps: int, gen: torch.Generator) -> tuple[float, float]:
        m = self.llg.LLMatcher(self.tok, compiled)
        mask = self.lt.allocate_token_bitmask(1, self.vocab)
        t_mask = t_apply = 0.0
        for _ in range(steps):
            logits = torch.randn(1, self.vocab, generator=gen)
            t0 = time.perf_counter()
            self.lt.fill_next_token_bitmask(m, mask, 0)
            t1 = time.perf_counter()
            self.lt.apply_token_bitmask_inplace(logits, mask)
            t_mask, t_apply = t_mask + t1 - t0, t_apply + time.perf_counter() - t1
            m.consume_token(int(logits.argmax()))
            if m.is_stopped():
                m.reset()
        return t_mask / steps, t_apply / steps


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def grammars() -> list[tuple[str, str, str]]:
    out = [(name, "json", json.dumps(s)) for name, s in SCHEMAS.items()]
    return [*out, ("json_object", "json", ""), ("regex", "regex", REGEX)]


def measure(engine_cls: type, model_dir: Path, vocab: int, steps: int, repeats: int) -> dict:
    setup, engine = timed(lambda: engine_cls(model_dir, vocab))
    rows = {}
    for name, kind, spec in grammars():
        compiles, masks, applies = [], [], []
        for r in range(repeats):
            dt, compiled = timed(lambda k=kind, s=spec: engine.compile(k, s))
            compiles.append(dt)
            mask_s, apply_s = engine.walk(compiled, steps, torch.Generator().manual_seed(r))
            masks.append(mask_s)
            applies.append(apply_s)
        rows[name] = {"compile_ms": [x * 1e3 for x in compiles],
                      "mask_us": [x * 1e6 for x in masks], "apply_us": [x * 1e6 for x in applies]}
    return {"setup_s": setup, "grammars": rows}


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    vocab = SIZES["0.5b"].vocab_size
    assert vocab is not None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tokenizer_dir(Path(tmp))
        results = {cls.name: measure(cls, model_dir, vocab, args.steps, args.repeats)
                   for cls in (XGrammar, LLGuidance)}
    print(f"vocab {vocab} logits; {args.steps} steps x {args.repeats} repeats; "
          "median [min-max]")
    for name, res in results.items():
        print(f"\n{name}: tokenizer setup {res['setup_s'] * 1e3:.0f} ms")
        print(f"  {'grammar':12s} {'compile ms':>24s} {'mask us/token':>24s} {'apply us/token':>24s}")
        for g, row in res["grammars"].items():
            print(f"  {g:12s} {spread(row['compile_ms']):>24s} {spread(row['mask_us']):>24s} "
                  f"{spread(row['apply_us']):>24s}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
