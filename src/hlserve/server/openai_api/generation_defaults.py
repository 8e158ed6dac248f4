"""The model's sampling defaults from its ``generation_config.json``, applied to requests
that leave a field out, as vLLM does (``--generation-config auto``, its default): the keys
vLLM reads are ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``
and ``max_new_tokens`` (the default ``max_tokens``). ``do_sample`` is ignored, as vLLM
ignores it. A value of the wrong type or range is left out (logged), not fatal: a file
written for another framework must not keep the server from starting."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("hlserve.server")

# generation_config key -> (request field, bounds check)
_KEYS: dict[str, tuple[str, Any]] = {
    "temperature": ("temperature", lambda v: v >= 0),
    "top_p": ("top_p", lambda v: 0 < v <= 1),
    "top_k": ("top_k", lambda v: isinstance(v, int) and v >= -1),
    "min_p": ("min_p", lambda v: 0 <= v <= 1),
    "repetition_penalty": ("repetition_penalty", lambda v: v > 0),
    "max_new_tokens": ("max_tokens", lambda v: isinstance(v, int) and v >= 1),
}


@dataclass(frozen=True)
class SamplingDefaults:
    """Request field -> the model's default for it."""

    values: dict[str, float | int] = field(default_factory=dict)

    @classmethod
    def load(cls, model_dir: str | Path) -> SamplingDefaults:
        path = Path(model_dir) / "generation_config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        if not isinstance(cfg, dict):
            return cls()
        values: dict[str, float | int] = {}
        for key, (name, ok) in _KEYS.items():
            v = cfg.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
                log.warning("generation_config.json: %s=%r is not usable; ignored", key, v)
                continue
            values[name] = v
        return cls(values)

    def apply(self, req: Any) -> Any:
        """``req`` with each defaulted field it left unset (None) filled in."""
        # max_tokens is bounded by the context: sampling_max_tokens applies it
        unset = {k: v for k, v in self.values.items()
                 if k != "max_tokens" and getattr(req, k, 0) is None}
        return req.model_copy(update=unset) if unset else req

    def max_tokens(self, rest: int) -> int:
        """The default ``max_tokens`` of a request that gives none: the rest of the
        context, or ``max_new_tokens`` if that is less (vLLM's rule)."""
        default = self.values.get("max_tokens")
        return rest if default is None else min(rest, int(default))
