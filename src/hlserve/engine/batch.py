"""The seam the engine owns between its scheduler and whatever executes a batch: the batch and
result types and the ``Runner`` interface.

The real runner (``runner/``) and the simulated one (``sim/sim_runner.py``) implement it; they
import this module, and the engine imports no runner (it is handed one)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from functools import cached_property

from hlserve.models.model_config import ModelConfig
from hlserve.request import Request, TokenLogprobs


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of an iteration: tokens ``[start, start + num_tokens)``.

    A speculating decode carries ``draft``: its last known token and the draft tokens after
    it, ``num_tokens == 1 + len(draft)`` query rows over its cached context, every row's
    logits verified (engine/spec_decode.py)."""

    request: Request
    start: int  # == request.num_computed when scheduled
    num_tokens: int
    page_table: list[int]
    draft: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so its logits give the next token."""
        return self.end - len(self.draft) == self.request.num_tokens

    @property
    def logit_rows(self) -> int:
        """How many of the chunk's last rows the step reads logits of: every row of a
        speculating decode (each verifies a draft token), the last row of any other chunk
        that samples, none of one that does not. The runner's sampling (``draft_rows``) and
        its last layer (``kept_rows``) both read this, so they keep the same rows."""
        if not self.samples:
            return 0
        return self.num_tokens if self.draft else 1

    @property
    def is_decode(self) -> bool:
        """One query row over a context: a plain decode, no draft."""
        return self.num_tokens == 1 and self.start > 0

    @property
    def decode_rows(self) -> int:
        """Query rows the decode attention paths can take, one decode each: 1 for a decode,
        1 + k for a speculating one (row i attends to the context and rows 0..i, which is
        a decode of length ``start + i + 1``: its K/V are in the cache before attention), 0
        for a prompt chunk."""
        return self.num_tokens if self.start > 0 and (self.draft or self.num_tokens == 1) else 0

    @property
    def is_prefill(self) -> bool:
        """Prompt (or recomputed) tokens: neither a decode nor a speculating decode."""
        return not self.decode_rows


@dataclass
class Batch:
    """One iteration's work: the scheduled sequences, in the order the scheduler chose."""

    seqs: list[ScheduledSeq] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self._counts[0]

    @property
    def num_prefill_tokens(self) -> int:
        return self._counts[1]

    @property
    def num_decodes(self) -> int:
        """Decoding requests, speculating ones included."""
        return self._counts[2]

    @cached_property
    def _counts(self) -> tuple[int, int, int]:
        """(tokens, prefill tokens, decodes) in one pass, once: the engine, the scheduler and
        the step's observers each read them every iteration (a batch is not changed once
        built: a retry after a failed forward builds a new one)."""
        tokens = prefill = decodes = 0
        for s in self.seqs:
            q = s.num_tokens
            tokens += q
            if s.is_prefill:
                prefill += q
            else:
                decodes += 1
        return tokens, prefill, decodes

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class StepResult:
    """Sampled token per request that reached its last token, and the step's duration."""

    tokens: dict[str, int]
    elapsed: float
    # a speculating request's accepted draft tokens, emitted before its token in ``tokens``
    # (which is then the target's correction or bonus token); absent: none accepted
    accepted: dict[str, list[int]] = field(default_factory=dict)
    # for requests whose params ask for logprobs (runners that compute them)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class Runner(abc.ABC):
    """What executes a batch. The engine receives one (built by whoever builds the engine)
    and knows it only through this interface."""

    model_config: ModelConfig
    num_pages: int
    page_size: int
    # time.monotonic() of the forward's last sign of progress (a layer begun), read from
    # another thread to tell a long step from a stuck one; 0.0: the runner reports none
    last_progress: float = 0.0
    # verifies draft tokens (ScheduledSeq.draft); an engine with speculation refuses a runner
    # without it
    supports_speculation: bool = False

    @abc.abstractmethod
    def execute(self, batch: Batch) -> StepResult: ...

    def release(self, request_id: str) -> None:  # noqa: B027 (optional hook)
        """Forget per-request state (e.g. a sampling generator) once a request ends."""
