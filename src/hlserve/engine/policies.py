"""Scheduler policies: small objects the scheduler composes, one per knob of DESIGN.md.

Each knob is an abstract base with one method; the scheduler asks, the policy answers, and
neither knows about tensors or clocks. New policies (throughput mode, presets) plug in here
without touching the scheduling pass.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from hlserve.request import Request


class OrderPolicy(abc.ABC):
    """Order of the waiting queue, i.e. who is considered for admission first."""

    @abc.abstractmethod
    def order(self, waiting: list[Request]) -> list[Request]: ...


class FCFS(OrderPolicy):
    def order(self, waiting: list[Request]) -> list[Request]:
        # a retracted request keeps its arrival time, so it goes back near the front
        return sorted(waiting, key=lambda r: r.arrival_time)


class MixingPolicy(abc.ABC):
    """Whether decodes share an iteration with prefill."""

    @abc.abstractmethod
    def decode_with_prefill(self) -> bool: ...


class AlwaysMix(MixingPolicy):
    """vLLM and Sarathi: decodes first, then prefill chunks, in every iteration."""

    def decode_with_prefill(self) -> bool:
        return True


class PrefillFirst(MixingPolicy):
    """SGLang's default: an iteration that can form a prefill batch runs prefill only."""

    def decode_with_prefill(self) -> bool:
        return False


class RetractionPolicy(abc.ABC):
    """Which running request gives up its KV when the pool runs out mid-decode."""

    @abc.abstractmethod
    def victim(self, candidates: Sequence[Request]) -> Request: ...


class FewestGenerated(RetractionPolicy):
    """SGLang: the request with the fewest output tokens (least work lost); ties to the
    longest prompt (frees the most pages)."""

    def victim(self, candidates: Sequence[Request]) -> Request:
        return min(candidates, key=lambda r: (len(r.output_token_ids), -r.num_prompt_tokens))


class LIFO(RetractionPolicy):
    """vLLM: the last admitted request (``candidates`` come in admission order)."""

    def victim(self, candidates: Sequence[Request]) -> Request:
        return candidates[-1]


def make_order(name: str) -> OrderPolicy:
    return {"fcfs": FCFS}[name]()


def make_mixing(name: str) -> MixingPolicy:
    return {"always": AlwaysMix, "prefill_first": PrefillFirst}[name]()


def make_retraction(name: str) -> RetractionPolicy:
    return {"fewest_generated": FewestGenerated, "lifo": LIFO}[name]()
