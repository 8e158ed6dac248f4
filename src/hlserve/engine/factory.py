"""The one engine factory: options → config (engine/args.py) → runner → Engine, for the real
runner (``hlserve.llm.build_engine``) and the simulated one (``hlserve.sim.build``) alike.

The runner is passed in as a constructor, so this module (and ``engine/``) imports no runner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hlserve.config import EngineConfig
from hlserve.engine.args import make_config
from hlserve.engine.batch import Runner
from hlserve.engine.engine import Engine
from hlserve.engine.presets import DeviceInfo


def build_engine(model: str, options: dict[str, Any], runner: Callable[[EngineConfig], Runner],
                 *, device_info: DeviceInfo | None = None,
                 tokenizer: Callable[[], Any] | None = None,
                 clock: Callable[[], float] | None = None) -> Engine:
    """An Engine on ``runner(config)``; ``device_info`` is what presets key their defaults on
    (detected when None: a simulated machine passes its own); ``tokenizer`` is loaded after
    the runner (a bad model directory fails on its weights first); ``clock`` None: the wall."""
    config = make_config(model, device_info=device_info, **options)
    built = runner(config)
    kwargs: dict[str, Any] = {} if clock is None else {"clock": clock}
    return Engine(config, built, tokenizer() if tokenizer is not None else None, **kwargs)
