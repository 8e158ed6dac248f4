"""The one engine factory: a config (made once, by engine/args.py's ``make_config``, or by
hand in a test) and a runner → an :class:`Engine`, for the real runner (``hlserve serve``,
``LLM(...)``) and the simulated one (``hlserve.sim.build``) alike. Nothing else constructs an
``Engine`` (tests/test_layout.py holds it to that).

It builds the engine's parts from the config (the KV cache on the runner's pool, speculative
decoding, the scheduler, which reads its caps from the config) and hands them to the
Engine. The runner is passed in, built or as a constructor, so this module (and
``engine/``) imports no runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hlserve.config import EngineConfig
from hlserve.engine.batch import Runner
from hlserve.engine.kv_cache import KVCacheManager
from hlserve.engine.llm_engine import Engine
from hlserve.engine.policies.names import check_policy_names
from hlserve.engine.scheduler import Scheduler
from hlserve.engine.spec_decode import SpecDecoder
from hlserve.engine.speculation import Speculator


def build_engine(config: EngineConfig, runner: Runner | Callable[[EngineConfig], Runner], *,
                 tokenizer: Callable[[str], Any] | None = None,
                 clock: Callable[[], float] | None = None,
                 speculator: Speculator | None = None) -> Engine:
    """An Engine on ``runner``: a Runner, or a constructor called with ``config`` (the real
    runner loads its weights there). ``tokenizer(config.model)`` is loaded after the runner (a
    bad model directory fails on its weights first); ``clock`` None: the wall;
    ``speculator``: the draft proposer of ``config.speculative_config`` (None: its method's,
    engine/speculation.py; the simulator passes its acceptance profile's)."""
    check_policy_names(config)  # before a runner loads any weights
    if speculator is not None and config.speculative_config is None:
        raise ValueError("a speculator was given for an engine without speculative_config")
    built = runner if isinstance(runner, Runner) else runner(config)
    tok = tokenizer(config.model) if tokenizer is not None else None
    max_model_len = config.max_model_len or built.model_config.max_position_embeddings
    kv = KVCacheManager(built.num_pages, built.page_size, config.enable_prefix_caching)
    spec = None
    if config.speculative_config is not None:
        spec = SpecDecoder(config.speculative_config, config.speculative_adaptive, speculator)
        if not built.supports_speculation:
            raise ValueError(f"speculative decoding is not supported by {type(built).__name__}")
    scheduler = Scheduler(config, kv, max_model_len, spec)
    return Engine(config, built, scheduler, tok, clock or time.monotonic)
