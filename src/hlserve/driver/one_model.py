"""One model load for a whole in-process A/B benchmark (benchmarks/speculation.py,
benchmarks/sessions.py): every run gets a fresh engine (its own KV manager, prefix cache,
sessions and statistics) on the same runner, whose KV tensors a new engine simply
overwrites, so arms differ in engine options only and no run inherits another's cache."""

from __future__ import annotations

from typing import Any

from hlserve.driver.closed_loop import greedy
from hlserve.engine.args import make_config
from hlserve.engine.factory import build_engine
from hlserve.engine.llm_engine import Engine
from hlserve.models.resolve import resolve_model
from hlserve.runner.torch_runner import TorchRunner
from hlserve.tokenizer import Tokenizer


class OneModel:
    """``base``: engine options of every run; an arm's options go on top of them."""

    def __init__(self, model: str, base: dict[str, Any]) -> None:
        self.model = model
        self.model_dir = resolve_model(model)  # a named model or .gguf file: its directory
        self.base = base
        self.runner = TorchRunner(make_config(self.model_dir, **base))

    def engine(self, arm: dict[str, Any]) -> Engine:
        """A fresh engine with ``arm``'s options, warmed outside any measurement by one short
        request of no session whose prompt has no repeats (nothing to draft)."""
        config = make_config(self.model_dir, **{**self.base, **arm})
        engine = build_engine(config, self.runner, tokenizer=Tokenizer.from_dir)
        engine.add_request(list(range(1000, 1040)), greedy(4))
        while engine.has_unfinished():
            engine.step()
        return engine
