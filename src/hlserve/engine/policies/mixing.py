"""Mixing of prefill and decode: whether an iteration may run prefill, and whether decodes
share it. ``mix_state`` is how either host reads its queue and pool for the two-stage
switch."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hlserve.config import EngineConfig


@dataclass(frozen=True)
class MixState:
    kv_usage: float  # fraction of the pool held by live requests
    pending_prefill_pages: int  # pages the waiting and mid-prefill requests still need
    evictable_pages: int
    num_decoding: int


class MixingPolicy(abc.ABC):
    needs_state = False  # whether ``plan`` reads its MixState (else the host need not build one)

    @abc.abstractmethod
    def plan(self, state: MixState) -> tuple[bool, bool]:
        """(prefill allowed, decodes share iterations that hold prefill)."""


class AlwaysMix(MixingPolicy):
    """vLLM and Sarathi: decodes first, then prefill chunks, in every iteration."""

    def plan(self, state: MixState) -> tuple[bool, bool]:
        return True, True


class PrefillFirst(MixingPolicy):
    """SGLang's default: an iteration that can form a prefill batch runs prefill only."""

    def plan(self, state: MixState) -> tuple[bool, bool]:
        return True, False


class TwoStage(MixingPolicy):
    """Stage 1 mixes. When KV use passes ``high`` and the pending prefill exceeds what can
    be evicted, prefill would only fill pages that decodes need to finish: stage 2 runs pure
    decode until use falls below ``low`` (hysteresis, so no flapping), then mixing resumes."""

    needs_state = True

    def __init__(self, high: float, low: float) -> None:
        self.high, self.low = high, low
        self.decode_only = False
        self.switches = 0

    def plan(self, state: MixState) -> tuple[bool, bool]:
        if self.decode_only:
            if state.kv_usage < self.low or state.num_decoding == 0:
                self.decode_only = False
                self.switches += 1
        elif state.kv_usage > self.high and state.pending_prefill_pages > state.evictable_pages:
            self.decode_only = True
            self.switches += 1
        return not self.decode_only, True


def mix_state(mixing: MixingPolicy, kv_usage: float, evictable_pages: int, page_size: int,
              waiting_uncomputed: Iterable[int], running_uncomputed: Iterable[int]) -> MixState:
    """A host's queue and pool as the mixing policy reads them (an empty state for one that
    reads none): the pages that the waiting requests and the running ones mid-prefill still
    need, and how many running requests decode (one token left to compute). Each iterable
    gives each request's uncomputed tokens."""
    if not mixing.needs_state:
        return MixState(0.0, 0, 0, 0)
    pending = sum(-(-n // page_size) for n in waiting_uncomputed)
    decoding = 0
    for n in running_uncomputed:
        if n > 1:
            pending += -(-n // page_size)
        else:
            decoding += 1
    return MixState(kv_usage, pending, evictable_pages, decoding)


# the knob's names, each with its constructor from the config: what ``--mixing`` lists, what a
# config is checked against (engine/policies/names.py) and what ``make_mixing`` builds
MIXINGS: dict[str, Callable[[EngineConfig], MixingPolicy]] = {
    "always": lambda config: AlwaysMix(),
    "prefill_first": lambda config: PrefillFirst(),
    "two_stage": lambda config: TwoStage(config.two_stage_high, config.two_stage_low),
}


def make_mixing(config: EngineConfig) -> MixingPolicy:
    return MIXINGS[config.mixing](config)

