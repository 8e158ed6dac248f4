"""Admission: whether a waiting request may start now, and the pass over the queue.

``AdmissionPolicy`` is the knob's base (``chunk``, ``reserve``, ``abort_guard``,
``backpressure``); ``AdmitPass`` is one pass over the ordered waiting queue (the limits, the
idle-pool rule and backfill), which hlserve's scheduler and the vLLM plugin both run on
their own view of the queue and the pool (pages or blocks).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Protocol

from hlserve.config import EngineConfig


class Admit:
    YES = "yes"
    WAIT = "wait"
    REJECT = "reject"
    STOP = "stop"  # (a pass's answer, not a policy's) this request and those behind it wait


class Pool(Protocol):
    """The pool as admission reads it: hlserve's ``KVCacheManager`` (pages), or the vLLM
    plugin's view of its block pool (``PoolShape``)."""

    page_size: int
    num_pages: int

    def pages_for(self, num_tokens: int) -> int: ...


@dataclass(frozen=True)
class PoolShape:
    """A pool's size and page size, for a host whose pool is not hlserve's."""

    page_size: int
    num_pages: int

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


@dataclass(frozen=True)
class AdmitQuery:
    num_tokens: int  # the request's tokens now (prompt and any output, after a retraction)
    remaining_output: int  # max_tokens less the tokens already generated
    cached_tokens: int
    chunk_pages: int  # pages the first chunk needs now
    headroom_pages: int  # free + evictable (minus matched pages that admission would lock)
    reserved_pages: int  # future growth of running requests, where the policy reserves it
    num_running: int = 0  # requests running now (they set a fair share and a growth margin)
    max_model_len: int | None = None  # no request grows past it, whatever its max_tokens


class AdmissionPolicy(abc.ABC):
    reserves = False
    # a request told to wait stops admission for this pass (head of line), unless the policy
    # backfills: then those behind it that fit are admitted around it
    backfill = False

    @abc.abstractmethod
    def decide(self, q: AdmitQuery, pool: Pool) -> str: ...

    def need_pages(self, q: AdmitQuery, pool: Pool) -> int:
        """Pages this request waits for (held back for it once it has waited long)."""
        return q.chunk_pages


class ChunkFits(AdmissionPolicy):
    """vLLM: admit when the next chunk fits now; growth is handled by preemption."""

    def decide(self, q: AdmitQuery, pool: Pool) -> str:
        return Admit.YES if q.chunk_pages <= q.headroom_pages else Admit.WAIT


def _projected_pages(q: AdmitQuery, pool: Pool, output_cap: int | None = None) -> int:
    """Pages the request holds at its end (prompt + remaining output, never past the model's
    length: a max_tokens beyond it cannot be used), less those the prefix cache serves."""
    out = q.remaining_output
    if output_cap is not None:
        out = min(out, output_cap)
    total = q.num_tokens + out
    if q.max_model_len is not None:
        total = min(total, q.max_model_len)
    return pool.pages_for(total) - q.cached_tokens // pool.page_size


class Reserve(AdmissionPolicy):
    """SGLang: headroom minus the reserved growth of running requests must hold the new
    request's prompt and (estimated, capped) output; otherwise it waits at the head."""

    reserves = True

    def decide(self, q: AdmitQuery, pool: Pool) -> str:
        need = max(q.chunk_pages, _projected_pages(q, pool, output_cap=4096))
        return Admit.YES if need <= q.headroom_pages - q.reserved_pages else Admit.WAIT


class AbortGuard(AdmissionPolicy):
    """The guard common in production: a request whose projected length (prompt + max new
    tokens) exceeds the current headroom is rejected, and its client must retry from
    scratch: an agent session loses its accumulated context."""

    def decide(self, q: AdmitQuery, pool: Pool) -> str:
        return Admit.YES if _projected_pages(q, pool) <= q.headroom_pages else Admit.REJECT


class Backpressure(AdmissionPolicy):
    """Throughput mode: a request is admitted when its prompt and projected output fit the
    pool's real headroom (free + evictable pages), so that running requests are not
    retracted to make room for it; one that does not fit waits until pages free up, and
    only one that could never fit is refused (at intake).

    A projection is only as good as its bound. Within a fair share of the pool,
    ``pool / (running + 1)`` pages, the request's own max_tokens (never past the model's
    length) is reserved in full. A request whose output the client did not bound within its
    share (no ``max_tokens``, every chat client's default, or one past the share) reserves
    only a margin of growth: a page for each running request and one for itself (at most
    the share), so that its admission does not force a retraction at once. Reserving the share instead made
    such a request wait, behind long streams that held most of the pool, until they
    finished: a convoy. Its growth past the margin is what retraction is for: when the pool
    runs out, throughput mode's victim is the request with the fewest generated tokens
    (normally the newcomer; its computed pages stay cached), and it is admitted again only
    once its margin is free again, which in a full pool only a request that ends frees, so
    retractions cannot repeat faster than requests end.

    A request that waits does not block those behind it that fit (backfill); the scheduler
    holds its pages back for it once it has waited long, so it is not starved either."""

    backfill = True

    def decide(self, q: AdmitQuery, pool: Pool) -> str:
        return Admit.YES if self.need_pages(q, pool) <= q.headroom_pages else Admit.WAIT

    def need_pages(self, q: AdmitQuery, pool: Pool) -> int:
        prompt = pool.pages_for(q.num_tokens) - q.cached_tokens // pool.page_size
        projected = _projected_pages(q, pool)
        share = pool.num_pages // (q.num_running + 1)
        if projected <= prompt + share:  # the client bounded its output within its share
            return max(q.chunk_pages, projected)
        # unbounded: the growth margin (never more than the share, in a pool of few pages)
        return max(q.chunk_pages, prompt + min(share, q.num_running + 1))


# the knob's names, each with its policy's class: what ``--admission`` lists, what a config is
# checked against (engine/policies/names.py) and what ``make_admission`` builds
ADMISSIONS: dict[str, type[AdmissionPolicy]] = {
    "chunk": ChunkFits, "reserve": Reserve, "abort_guard": AbortGuard,
    "backpressure": Backpressure,
}


def make_admission(config: EngineConfig) -> AdmissionPolicy:
    return ADMISSIONS[config.admission]()



# ---- the pass over the waiting queue --------------------------------------------------------

# backfilling admission: passes a request may wait while others overtake it before its pages
# are held back for it, and how many waiting requests one pass looks past (a pass over
# thousands waiting must stay cheap)
BACKFILL_PATIENCE_STEPS = 256
BACKFILL_MAX_SKIPS = 32


@dataclass(frozen=True, slots=True)
class Candidate:
    """A waiting request as a host sees it when its turn comes in a pass."""

    request_id: str
    num_tokens: int
    remaining_output: int  # max_tokens less the tokens already generated
    cached_tokens: int  # served by the prefix cache (never the last token)
    num_new_tokens: int  # its first chunk: min(uncached, chunk cap, budget left)
    chunk_pages: int  # pages that chunk needs now
    locked_pages: int  # matched pages nobody holds: counted as free now, but admission takes them
    reserved_pages: int = 0  # running requests' future growth (a reserving policy's hosts only)


class Admission:
    """A host's admission across passes: the policy and limits of its config, and the step
    at which backfill first passed over each waiting request (a request passed over for
    ``BACKFILL_PATIENCE_STEPS`` has its pages held back from those behind it)."""

    def __init__(self, config: EngineConfig, max_model_len: int | None) -> None:
        self.config = config
        self.policy = make_admission(config)
        self.max_model_len = max_model_len
        self._held_since: dict[str, int] = {}

    def begin(self, step: int, num_running: int, mid_chunk: int) -> AdmitPass:
        """A pass; ``num_running`` and ``mid_chunk`` (requests whose prefill is split across
        iterations) as they stand before it admits anything."""
        return AdmitPass(self, step, num_running, mid_chunk)

    def forget(self, request_id: str) -> None:
        """The request left the waiting queue (admitted, rejected or ended)."""
        self._held_since.pop(request_id, None)


@dataclass(slots=True)
class AdmitPass:
    """One pass over the ordered waiting queue, the rules of admission that do not depend on
    the host. For each request in turn the host asks ``full`` (stop before looking at it),
    then builds its ``Candidate`` and asks ``decide``; it tells ``admitted`` after admitting
    one, and reads the pool afresh for the next (an admission takes pages)."""

    admission: Admission
    step: int
    num_running: int  # running requests, those admitted in this pass included
    mid_chunk: int
    held_back: int = 0  # pages kept for long-waiting requests that backfill passed over
    skips: int = 0  # requests passed over

    def full(self, budget_left: float, prefill_tokens: int) -> bool:
        """The running-request limit, the iteration's budget or the prefill cap is reached."""
        cfg = self.admission.config
        return (self.num_running >= cfg.max_num_seqs or budget_left < 1
                or (cfg.max_prefill_tokens is not None and prefill_tokens >= cfg.max_prefill_tokens))

    def decide(self, c: Candidate, available: int, used_pages: int, pool: Pool) -> str:
        """``Admit.YES``, ``WAIT`` (passed over: the pass goes on), ``STOP`` (it and those
        behind it wait) or ``REJECT``. ``available``: the pages an allocation could get now
        (free + evictable); ``used_pages``: those held by live requests. No policy holds an
        idle pool: alone, a request is admitted when its chunk fits."""
        adm = self.admission
        cfg, policy = adm.config, adm.policy
        if c.num_new_tokens < c.num_tokens - c.cached_tokens and cfg.max_chunked_prefills is not None \
                and self.mid_chunk >= cfg.max_chunked_prefills:
            return Admit.STOP
        headroom = available - c.locked_pages - self.held_back
        q = AdmitQuery(c.num_tokens, c.remaining_output, c.cached_tokens, c.chunk_pages, headroom,
                       c.reserved_pages, self.num_running, adm.max_model_len)
        verdict = policy.decide(q, pool)
        if verdict == Admit.REJECT:
            return verdict
        if verdict == Admit.WAIT and self.num_running == 0 and used_pages == 0:
            verdict = Admit.YES
        if verdict == Admit.WAIT or c.chunk_pages > headroom:
            if not policy.backfill:
                return Admit.STOP
            # backfill: those behind it that fit go first; once it has waited long, its
            # pages are held back from them, so it is not starved
            since = adm._held_since.setdefault(c.request_id, self.step)
            if self.step - since >= BACKFILL_PATIENCE_STEPS:
                self.held_back += min(max(headroom, 0), policy.need_pages(q, pool))
            self.skips += 1
            return Admit.STOP if self.skips >= BACKFILL_MAX_SKIPS else Admit.WAIT
        return Admit.YES

    def admitted(self, c: Candidate) -> None:
        self.num_running += 1
        if c.num_new_tokens < c.num_tokens - c.cached_tokens:
            self.mid_chunk += 1
