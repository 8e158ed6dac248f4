"""Engine configuration: one frozen dataclass, the knobs named as in DESIGN.md and vLLM."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MIXING = ("always", "prefill_first")
ORDERS = ("fcfs",)
RETRACTIONS = ("fewest_generated", "lifo")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto (cuda if present) | cpu | cuda | cuda:N
    seed: int = 0
    # KV pool (safety caps)
    page_size: int = 16
    num_pages: int | None = None  # overrides kv_cache_gb
    kv_cache_gb: float = 2.0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256  # running-request limit
    enable_prefix_caching: bool = True
    # latency caps
    chunk_size: int | None = None  # None: a prompt is prefilled in one pass
    token_budget: int | None = None  # tokens per iteration (vLLM's max_num_batched_tokens)
    # policies
    mixing: str = "always"
    order: str = "fcfs"
    retraction: str = "fewest_generated"
    # checking: verify KV accounting after every step (tests turn this on)
    check_invariants: bool = False

    def __post_init__(self) -> None:
        for name in ("page_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("chunk_size", "token_budget", "num_pages", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or unset, got {value}")
        for name, allowed in (("mixing", MIXING), ("order", ORDERS), ("retraction", RETRACTIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}
