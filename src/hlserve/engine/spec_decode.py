"""Speculative decoding in the engine: which requests speculate, how many draft tokens each
gets this step, and the counters vLLM's ``vllm:spec_decode_*`` metrics read.

The scheduler asks :meth:`SpecDecoder.draft` for a decoding request's drafts; the request is
then scheduled as ``1 + len(draft)`` query rows (counted against the token budget, with KV
slots). The runner verifies every row (runner/speculative.py) and returns the accepted drafts
and one more token; the engine appends them one by one (so EOS, stop ids, stop strings,
``min_tokens`` and ``max_tokens`` end the request at the exact token) and the scheduler frees
the pages that held rejected drafts the same step (``Scheduler.settle_draft``).

A request speculates only where speculation is exact and hlserve handles it per row: not
with a grammar (the matcher would have to advance through the draft and roll back), logprobs
(one entry per emitted token would need every row's distribution), penalties or
``logit_bias`` (their counts change inside the draft), a thinking budget (a forced end
token inside the draft). Those requests decode one token per
step, as vLLM does for several of them.

k is ``num_speculative_tokens`` every step, or with ``speculative_adaptive`` (throughput
mode's default) chosen per step from the measured acceptance and step cost
(engine/spec_adaptive.py): the scheduler calls :meth:`SpecDecoder.begin_step` once per pass
before the drafts, and :meth:`SpecDecoder.observe_step` with the step's time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hlserve.config import SpeculativeConfig
from hlserve.engine.spec_adaptive import AdaptiveK
from hlserve.engine.speculation import Speculator, make_speculator
from hlserve.request import Request


@dataclass
class SpecStats:
    """Running totals with vLLM's meanings: a draft is one request's non-empty proposal in
    one step; ``accepted_per_pos[i]``: drafts whose token at position i was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # drafts that reached position i (a proposal may be shorter than k): acceptance at i
    # among the drafts that tried it, what a simulated profile needs (sim/acceptance_profile.py)
    drafted_per_pos: list[int] = field(default_factory=list)
    num_lookups: int = 0  # proposals asked for (a draft or none): drafts / lookups is the match rate
    # the per-step choice of k (steps by k, probes, acceptance per position); None: fixed k
    adaptive: AdaptiveK | None = None

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        for i in range(num_draft):
            self.drafted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


def speculates(req: Request) -> bool:
    """Whether a request may carry drafts (see the module's docstring for why not)."""
    p = req.params
    return (req.grammar is None and p.structured_outputs is None and p.logprobs is None
            and not p.adjusts_logits and p.thinking is None)


class SpecDecoder:
    """The engine's speculation: the config, its speculator and the counters."""

    def __init__(self, config: SpeculativeConfig, adaptive: bool = False,
                 speculator: Speculator | None = None) -> None:
        """``EngineConfig.speculative_config`` and ``speculative_adaptive``; ``speculator``
        None: the config's method's (the simulator gives its acceptance profile's)."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.speculator: Speculator = speculator if speculator is not None \
            else make_speculator(config)
        self.adaptive = AdaptiveK(self.k) if adaptive else None
        self.stats = SpecStats(accepted_per_pos=[0] * self.k, drafted_per_pos=[0] * self.k,
                               adaptive=self.adaptive)
        self._step_k = self.k  # this step's k (begin_step); fixed k without adaptive
        self._probe = False  # one request of this step may still draft k_max (a probe)
        self._eligible: dict[str, bool] = {}  # speculates(req), once per request

    def describe(self) -> str:
        """The start-up line."""
        c = self.config
        detail = (f"prompt_lookup {c.prompt_lookup_min}..{c.prompt_lookup_max}"
                  if c.method == "ngram" else
                  f"tree depth {c.suffix_decoding_max_tree_depth}, spec factor "
                  f"{c.suffix_decoding_max_spec_factor}, min prob "
                  f"{c.suffix_decoding_min_token_prob}")
        how = (f"up to {self.k} draft tokens per decode" if self.adaptive is None else
               f"k chosen per step in 0..{self.k} (adaptive: the most expected tokens per "
               f"second from the EMAs of draft reach and acceptance per position, alpha {self.adaptive.alpha}, "
               f"and the fitted step cost t0 + t_row x rows; a draft token below "
               f"{self.adaptive.min_gain} acceptance never; a probe every "
               f"{self.adaptive.probe_every} steps at k 0)")
        return (f"speculative decoding: {c.method}, {how} ({detail}); off for requests with "
                "a grammar, logprobs, penalties or logit_bias")

    def begin_step(self, decodes: int, spare: float) -> None:
        """A scheduling pass starts its drafts: ``decodes`` decoding requests, ``spare``
        tokens of budget after them. Sets this step's k (adaptive) or keeps k_max."""
        if self.adaptive is not None:
            self._step_k, self._probe = self.adaptive.choose(decodes, spare)

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step's forward ran ``rows`` query rows in ``seconds`` (the adaptive cost fit)."""
        if self.adaptive is not None:
            self.adaptive.observe_step(rows, seconds)

    def draft(self, req: Request, limit: float, max_model_len: int) -> list[int]:
        """Up to ``limit`` (the budget the step's decodes leave) draft tokens for a decoding
        request, never more than it can still emit (the step emits up to 1 + k tokens)."""
        rid = req.request_id
        ok = self._eligible.get(rid)
        if ok is None:  # a request's params and grammar do not change while it runs
            ok = self._eligible[rid] = speculates(req)
        if not ok:
            return []
        prompt, output = req.prompt_token_ids, req.output_token_ids
        left = min(req.params.max_tokens - len(output),
                   max_model_len - len(prompt) - len(output))
        probing = self._step_k == 0 and self._probe
        k = int(min(self.k if probing else self._step_k, limit, left - 1))
        if k <= 0:
            return []
        self.stats.num_lookups += 1
        draft = self.speculator.draft(rid, prompt, output, k)[:k]
        if self.adaptive is not None:
            self.adaptive.observe_lookup(k, len(draft))
            if draft and probing:
                self._probe = False  # one probe per step
                self.adaptive.probes += 1
        return draft

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.stats.record(num_draft, num_accepted)
        if self.adaptive is not None:
            self.adaptive.observe_draft(num_draft, num_accepted)

    def finish(self, request_id: str) -> None:
        self._eligible.pop(request_id, None)
        self.speculator.finish(request_id)
