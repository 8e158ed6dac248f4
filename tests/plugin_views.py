"""vLLM-shaped views for the vLLM plugin's half that needs no vLLM
(``plugin_policy.PluginPolicy``): a request with vLLM's attribute names, and prefix caches
for its order and admission (none, or hlserve's radix tree read the way the plugin reads
vLLM's block pool: matched blocks and those of them nobody holds)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from hlserve.engine.kv_cache import KVCacheManager
from hlserve.integrations.plugin_policy import PrefixCacheOrder
from hlserve.request import Request


@dataclass
class VReq:
    """The fields of ``vllm.v1.request.Request`` that the plugin reads."""

    request_id: str
    num_tokens: int
    num_computed_tokens: int = 0
    max_tokens: int = 16
    num_output_tokens: int = 0
    arrival_time: float = 0.0
    priority: int = 0
    sampling_params: Any = None
    tokens: list[int] = field(default_factory=list)  # (for a cache read from hlserve's tree)

    @classmethod
    def of(cls, r: Request) -> VReq:
        """hlserve's request as vLLM would show it."""
        return cls(r.request_id, r.num_tokens, r.num_computed, r.params.max_tokens,
                   len(r.output_token_ids), r.arrival_time, r.priority,
                   SimpleNamespace(extra_args={"request_class": r.request_class.value}),
                   r.all_token_ids)


def vreq(rid: str, num_tokens: int, max_tokens: int = 16, computed: int = 0, output: int = 0,
         arrival: float = 0.0, cls: str | None = None) -> VReq:
    extra = {"request_class": cls} if cls else {}
    return VReq(rid, num_tokens, computed, max_tokens, output, arrival, 0,
                SimpleNamespace(extra_args=extra))


class NoPrefixCache(PrefixCacheOrder):
    """Prefix caching off: nothing is ever cached."""

    def __init__(self, aging: float = 4.0) -> None:
        super().__init__(aging, fcfs_fallback=None)

    def cached_tokens(self, req: Any, step: int) -> int:
        return 0

    def unheld_cached_blocks(self, req: Any) -> int:
        return 0


class TreePrefixCache(PrefixCacheOrder):
    """hlserve's radix tree seen as the plugin sees vLLM's block pool: each request matched
    afresh, and the matched blocks with no holder counted."""

    def __init__(self, kv: KVCacheManager, aging: float) -> None:
        super().__init__(aging, fcfs_fallback=None)
        self.kv = kv
        self._unheld: dict[str, int] = {}

    def cached_tokens(self, req: Any, step: int) -> int:
        nodes = self.kv.match_prefix(req.tokens, req.num_tokens - 1)
        self._unheld[req.request_id] = sum(1 for n in nodes if n.ref == 0)
        return len(nodes) * self.kv.page_size

    def unheld_cached_blocks(self, req: Any) -> int:
        return self._unheld[req.request_id]

    def forget(self, req: Any) -> None:
        super().forget(req)
        self._unheld.pop(req.request_id, None)
