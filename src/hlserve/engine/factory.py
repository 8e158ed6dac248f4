"""The one engine factory: a config (built once, by engine/args.py's ``make_config``) → runner
→ Engine, for the real runner (``hlserve.llm``, ``hlserve serve``) and the simulated one
(``hlserve.sim.build``) alike.

The runner is passed in as a constructor, so this module (and ``engine/``) imports no runner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hlserve.config import EngineConfig
from hlserve.engine.batch import Runner
from hlserve.engine.engine import Engine


def build_engine(config: EngineConfig, runner: Callable[[EngineConfig], Runner], *,
                 tokenizer: Callable[[str], Any] | None = None,
                 clock: Callable[[], float] | None = None) -> Engine:
    """An Engine on ``runner(config)``; ``tokenizer(config.model)`` is loaded after the runner
    (a bad model directory fails on its weights first); ``clock`` None: the wall."""
    built = runner(config)
    kwargs: dict[str, Any] = {} if clock is None else {"clock": clock}
    tok = tokenizer(config.model) if tokenizer is not None else None
    return Engine(config, built, tok, **kwargs)
