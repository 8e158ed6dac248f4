"""Requests, their sampling parameters and their outputs: the vocabulary every layer shares."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Any

from hlserve.errors import InvalidRequestError
from hlserve.structured.params import StructuredOutputsParams
from hlserve.structured.thinking import ThinkingBudget


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, named as in vLLM and the OpenAI API."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0  # keep tokens with probability >= min_p x the top token's (0: off)
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    # log-probabilities of each sampled token and of the ``logprobs`` most likely ones, from
    # the model's raw distribution (vLLM's default); None: not computed
    logprobs: int | None = None
    # logits adjustments, vLLM's semantics (applied before temperature and the filters):
    # repetition over prompt and output tokens (a positive logit divided by it, a negative one
    # multiplied); presence / frequency over output tokens only (subtracted once / per count)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id -> bias added to its logit; not hashed (a dict), compared
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    # n choices per prompt (forked sequences sharing the prompt's pages); best_of >= n
    # sequences are generated and the n of highest cumulative logprob returned (vLLM V0)
    n: int = 1
    best_of: int | None = None
    # constrained decoding (JSON schema, regex, choice, grammar): the sampler masks every
    # token the grammar does not allow (hlserve.structured); None: unconstrained
    structured_outputs: StructuredOutputsParams | None = None
    # False: special tokens stay in the text (vLLM's flag; the server sets it when tools are
    # present, since a tokenizer may mark a tool-call tag as special)
    skip_special_tokens: bool = True
    # vLLM's thinking_token_budget: at most this many tokens per reasoning section, then
    # its end is forced (hlserve.structured.thinking); None: no budget. Not applied to a
    # constrained request, whose grammar leaves no room to think
    thinking: ThinkingBudget | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_tuple(self.stop, "stop", str))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", int))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _as_bias(self.logit_bias))
        self.validate()

    def validate(self) -> None:
        """Reject anything the runner could not sample with: a bad value caught here is one
        rejected request; the same value reaching a batch would fail the whole step. Integers
        go into int64 tensors and floats into float32 ones, hence the upper bounds."""
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT32_MAX:
            raise InvalidRequestError(f"max_tokens must be an integer in [1, {INT32_MAX}], got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise InvalidRequestError(f"top_k must be -1 or 0 (off) or a positive integer up to {INT32_MAX}, got {self.top_k!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise InvalidRequestError(f"seed must be a 64-bit integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidRequestError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= INT32_MAX:
                raise InvalidRequestError(f"stop_token_ids must be integers in [0, {INT32_MAX}], got {t!r}")
        self._validate_adjustments()
        self._validate_choices()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError("structured_outputs must be StructuredOutputsParams")
            self.structured_outputs.validate()
        if self.thinking is not None:
            if not isinstance(self.thinking, ThinkingBudget):
                raise InvalidRequestError("thinking must be a ThinkingBudget")
            self.thinking.validate()

    def _validate_adjustments(self) -> None:
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= FLOAT32_MAX:
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, "
                                          f"got {len(self.logit_bias)}")
            for t, b in self.logit_bias.items():
                if not _is_int(t) or not 0 <= t <= INT32_MAX:
                    raise InvalidRequestError(f"logit_bias keys must be token ids, got {t!r}")
                if not _is_real(b) or not -100 <= b <= 100:
                    raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {b!r} "
                                              f"for token {t}")

    def _validate_choices(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of)
                                         or not self.n <= self.best_of <= MAX_N):
            raise InvalidRequestError(
                f"best_of must be an integer in [n={self.n}, {MAX_N}], got {self.best_of!r}")

    @property
    def num_sequences(self) -> int:
        """How many sequences a prompt forks into: best_of, else n."""
        return self.best_of or self.n

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler has penalties or a bias to apply (else it does no extra work)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))

    def for_sibling(self, i: int) -> SamplingParams:
        """Sequence ``i`` of a fork: one choice, and with a seed its own (seed + i, as vLLM
        derives them, wrapped into the seed range) so seeded siblings differ but reproduce.
        best_of needs each sequence's cumulative logprob, so it computes logprobs."""
        seed = self.seed
        if seed is not None and i:
            seed = (seed + i + 2**63) % 2**64 - 2**63
        logprobs = self.logprobs
        if self.best_of is not None and self.best_of > self.n and logprobs is None:
            logprobs = 0
        return replace(self, n=1, best_of=None, seed=seed, logprobs=logprobs)

    @property
    def greedy(self) -> bool:
        # as in vLLM: a temperature this small is greedy; dividing logits by it would overflow
        return self.temperature < _SAMPLING_EPS


_SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20  # the OpenAI API's limit on top_logprobs
MAX_N = 128  # sequences per prompt (n, best_of): bounded work per request
MAX_LOGIT_BIAS = 1024  # entries: each costs a scatter per step
INT32_MAX = 2**31 - 1  # counts and token ids: plenty, and safe in any index tensor
FLOAT32_MAX = 3.4028234663852886e38  # larger floats are inf once in a float32 tensor


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _as_bias(value: object) -> dict:
    """``logit_bias`` as a dict (a copy: the params are frozen); keys as sent."""
    if not isinstance(value, dict):
        raise InvalidRequestError(f"logit_bias must be a mapping of token id to bias, got {value!r}")
    return dict(value)


def _as_tuple(value: object, name: str, kind: type) -> tuple:
    """``None`` -> (), a single value -> a 1-tuple, any other iterable -> a tuple."""
    if value is None:
        return ()
    if isinstance(value, (str, kind)) and not isinstance(value, bool):
        return (value,)
    try:
        return tuple(value)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidRequestError(f"{name} must be a list, got {value!r}") from None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended; the values are vLLM's (and the OpenAI API's ``finish_reason``)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's length limit
    # ended unfinished without a fault: cancelled by the caller (no error), or refused by the
    # admission policy once queued (``error`` says why), as vLLM ends a request it drops
    ABORT = "abort"
    ERROR = "error"  # a fault ended it: its forward, its output or its step failed (see error)


class RequestClass(str, enum.Enum):
    """Who waits on a request: a person (latency caps apply) or a program (throughput)."""

    INTERACTIVE = "interactive"
    AGENT = "agent"


REQUEST_CLASSES: tuple[str, ...] = tuple(c.value for c in RequestClass)


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability and the most likely alternatives' (best first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


_ids = itertools.count()
_seqs = itertools.count()


@dataclass(eq=False)
class Request:
    """Scheduler-side state of one request.

    ``num_computed`` counts tokens of ``all_token_ids`` whose KV is in the cache. A request
    needs a forward over ``all_token_ids[num_computed:]``; once that covers every token but
    none is left, it samples. A retracted request keeps its output tokens: on re-admission
    they are prefilled again together with the prompt (recompute, as vLLM and SGLang do).
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    seq: int = field(default_factory=lambda: next(_seqs))  # creation order: a total tie-break
    request_class: RequestClass = RequestClass.AGENT
    priority: int = 0  # lower value = served first (vLLM's convention)
    arrival_time: float = field(default_factory=time.monotonic)
    eos_token_ids: frozenset[int] = frozenset()
    # prefix-cache namespace (vLLM's ``cache_salt``): pages cached under one salt are never
    # matched by a request with another; None is the shared namespace
    cache_salt: str | None = None
    # the agent session it is a round of (engine/sessions.py:session_key, salt-scoped); None: none
    session: str | None = None
    # the session has finished a round before (its context may be retained); set on arrival
    returning: bool = False
    # a forked sibling (n > 1) waits for its leader's prefill, then finds the prompt's pages
    # in the prefix cache instead of computing them again
    leader: Request | None = None
    # the grammar matcher of a constrained request (hlserve.structured.grammar.GrammarState),
    # advanced by the engine with each token it appends; None: unconstrained
    grammar: Any = None
    # where its reasoning is against params.thinking (hlserve.structured.thinking
    # .ThinkingState), synced by the runner before each sample; None: no budget
    thinking: Any = None

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    num_cached_prompt: int = 0  # prompt tokens served by the prefix cache at first admission
    num_retractions: int = 0
    # prompt tokens looked up in / served by the prefix cache, over every admission (a
    # re-admission after retraction looks up again): vLLM's prefix_cache_queries / _hits
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    # timeline, in the engine clock's seconds
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    # per output token, when params.logprobs is set: (its logprob, [(id, logprob)] top ones)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # text state, owned by the output processor
    output_text: str = ""
    stop_reason: str | int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """More than the last token is still uncomputed (a prompt, or a retracted request)."""
        return self.num_uncomputed > 1

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens


@dataclass
class CompletionOutput:
    """One choice of a prompt (vLLM's ``CompletionOutput``): n > 1 gives several."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """What a caller gets back: final or, when streaming, cumulative so far. The top-level
    text and tokens are the first choice's; ``outputs`` lists every choice (vLLM's shape)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float | None] = field(default_factory=dict)
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when asked for
    choices: list[CompletionOutput] | None = None  # n > 1: every choice; None: just this one

    @property
    def outputs(self) -> list[CompletionOutput]:
        if self.choices is not None:
            return self.choices
        return [self.as_choice(0)]

    def as_choice(self, index: int) -> CompletionOutput:
        return CompletionOutput(index, self.text, list(self.token_ids), self.cumulative_logprob,
                                self.logprobs, self.finish_reason, self.stop_reason)

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs, when they were computed."""
        return None if self.logprobs is None else sum(e.logprob for e in self.logprobs)

    @classmethod
    def of(cls, req: Request) -> RequestOutput:
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=req.output_text,
            finished=req.finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            stop_reason=req.stop_reason,
            error=req.error,
            num_cached_tokens=req.num_cached_prompt,
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
            metrics={
                "arrival_time": req.arrival_time,
                "first_scheduled_time": req.first_scheduled_time,
                "first_token_time": req.first_token_time,
                "finish_time": req.finish_time,
            },
        )


def best_choices(outs: list[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    """The outputs to return of a prompt's forked sequences: all, or with best_of the n of
    highest cumulative logprob (vLLM V0's best_of; ties keep fork order)."""
    if params.best_of is None or params.best_of <= params.n:
        return outs
    return sorted(outs, key=lambda o: -(o.cumulative_logprob or 0.0))[: params.n]


def merge_choices(outs: list[RequestOutput], params: SamplingParams) -> RequestOutput:
    """A prompt's forked sequences as one output (vLLM's ``RequestOutput.outputs``)."""
    chosen = best_choices(outs, params)
    if len(outs) == 1:
        return outs[0]
    choices = [o.as_choice(i) for i, o in enumerate(chosen)]
    if params.logprobs is None:  # best_of computed them only to rank the sequences
        choices = [replace(c, logprobs=None) for c in choices]
        return replace(chosen[0], logprobs=None, choices=choices)
    return replace(chosen[0], choices=choices)
