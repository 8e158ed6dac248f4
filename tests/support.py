"""A stand-in runner for scheduler tests: the scheduler is under test, not the model.

Tokens are a pure function of each request's history (so a retracted and recomputed request
must produce the very same tokens), each chunk is checked to continue exactly where the
request's KV ends, and each step takes a deterministic time (``overhead + per_token x
tokens + per_context x context``) so that time-driven policies can be tested on a virtual
clock without timing flakiness.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from hlserve.engine.batch import Batch, Runner, StepResult
from hlserve.models.model_config import ModelConfig

VOCAB = 8


class HistoryRunner(Runner):
    """Token = a hash of the whole sequence so far; checks that each chunk continues exactly
    where the request's KV ends and that it only writes into its own pages."""

    def __init__(self, num_pages: int, page_size: int, overhead: float = 0.0,
                 per_token: float = 0.0, per_context: float = 0.0, check: bool = True) -> None:
        self.cost = (overhead, per_token, per_context)
        self.check = check
        self.batches: list[Batch] = []  # what each step ran (token counts), for assertions
        self.model_config = ModelConfig(
            architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=8,
            intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=1 << 16,
        )
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_content: dict[int, int] = {}  # slot -> token whose "KV" it holds

    def execute(self, batch: Batch) -> StepResult:
        out = {}
        slots_seen: set[int] = set()
        self.batches.append(batch)
        overhead, per_token, per_context = self.cost
        elapsed = overhead + per_token * batch.num_tokens
        elapsed += per_context * sum(s.end for s in batch.seqs)
        for seq in batch.seqs:
            req = seq.request
            tokens = req.all_token_ids
            ps = self.page_size
            # context before the chunk must already be in this request's pages
            for pos in range(seq.start if self.check else 0):
                slot = seq.page_table[pos // ps] * ps + pos % ps
                assert self.kv_content.get(slot) == tokens[pos], "stale or foreign KV"
            for pos in range(seq.start, seq.end):
                slot = seq.page_table[pos // ps] * ps + pos % ps
                assert slot not in slots_seen, "two sequences write one slot"
                slots_seen.add(slot)
                self.kv_content[slot] = tokens[pos]
            if seq.samples:
                out[req.request_id] = hash(tuple(req.all_token_ids)) % VOCAB
        return StepResult(tokens=out, elapsed=elapsed)




def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (benchmarks are scripts, not a package), registered
    under ``name`` so its dataclasses and pickling find it."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding by a full forward per token: the reference tokens."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


# ---- the Responses API tests' server (test_responses_api.py, test_responses_store.py) -------
RESPONSES_MODEL = "tiny"
RESPONSES_ARGS = ["--served-model-name", RESPONSES_MODEL, "--dtype", "float32",
                  "--max-model-len", "2048", "--max-num-seqs", "8", "--uvicorn-log-level",
                  "warning", "--cpu-threads", "1", "--tool-call-parser", "hermes",
                  "--enable-auto-tool-choice"]
ADD_TOOL = {"type": "function", "name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}


@contextlib.contextmanager
def responses_server(model_dir: Path, tmp: Path, *extra: str) -> Iterator[object]:
    """A real ``hlserve serve`` of the tiny Qwen2 model with the hermes tool parser, for the
    Responses API tests; its log must hold no traceback when it stops."""
    from hlserve.server.runtime.launch import ServerProcess

    with ServerProcess(model_dir, [*RESPONSES_ARGS, *extra], log_path=tmp / "server.log") as srv:
        yield srv
        assert "Traceback" not in srv.log_text(), srv.log_text()[-4000:]


def assert_bf16_linear(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor,
                       w: torch.Tensor) -> None:
    """``got`` is the bf16 linear ``want`` but for fp32 summation order: few elements differ
    (near zero, where the fp32 sums' error shows), by no more than that error allows."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got != want).float().mean() < 0.01
    # the two fp32 sums may differ by the dot product's error bound, K * 2^-24 * sum |x w|
    # each; then each rounds to bf16, by up to half an ulp, at most 2^-8 of its value: two
    # sums either side of a rounding boundary land one ulp apart
    k = x.shape[-1]
    mag = x.double().abs() @ w.double().abs().T
    bound = 2 * k * 2.0**-24 * mag + 2 * 2.0**-8 * want.double().abs() + 2.0**-133
    assert bool(((got.double() - want.double()).abs() <= bound).all())
