"""Retraction: which running request gives up its KV when the pool runs out."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from hlserve.config import EngineConfig
from hlserve.request import Request


class RetractionPolicy(abc.ABC):
    """Which running request gives up its KV when the pool runs out mid-decode."""

    @abc.abstractmethod
    def victim(self, candidates: Sequence[Request]) -> Request: ...


class FewestGenerated(RetractionPolicy):
    """SGLang: the request with the fewest output tokens (least work lost); ties to the
    longest prompt (frees the most pages), then to the newest. The order is total, so the
    safest request is the same in every pass and always progresses."""

    def victim(self, candidates: Sequence[Request]) -> Request:
        return min(candidates, key=lambda r: (len(r.output_token_ids), -r.num_prompt_tokens, -r.seq))


class LIFO(RetractionPolicy):
    """vLLM: the last arrived request. (vLLM takes the last admitted; a request re-admitted
    after retraction would then rank newest and two requests could retract each other in
    turn, so the rank here is fixed at arrival.)"""

    def victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: r.seq)


class PriorityVictim(RetractionPolicy):
    """Lowest priority first (largest ``priority`` value), then the latest arrival."""

    def victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: (r.priority, r.seq))


# the knob's names, each with its policy's class: what ``--retraction`` lists, what a config is
# checked against (engine/policies/names.py) and what ``make_retraction`` builds
RETRACTIONS: dict[str, type[RetractionPolicy]] = {
    "fewest_generated": FewestGenerated, "lifo": LIFO, "priority": PriorityVictim,
}


def make_retraction(config: EngineConfig) -> RetractionPolicy:
    return RETRACTIONS[config.retraction]()

