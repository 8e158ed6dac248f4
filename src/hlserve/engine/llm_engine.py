"""The engine loop: ``schedule -> execute -> update``, plus request intake and output.

The engine validates requests (a bad one raises :class:`InvalidRequestError` and nothing
else is touched), owns the clock, appends sampled tokens, decides when a request stops
(EOS, stop ids, stop strings, ``max_tokens``, the model's length) and hands pages back. It
fails a broken batch or step alone (engine/faults.py). Its callers read what it offers
(``stats``, ``model_config``, ``running``, ``kv_usage``, ...), never its parts; it is built
by ``engine/factory.py:build_engine`` alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from hlserve.config import EngineConfig
from hlserve.engine.batch import Batch, Runner, StepResult
from hlserve.engine.counters import Counters, EngineStats
from hlserve.engine.faults import FailureStreak, bisect_forward, merge_runs, stranded_requests
from hlserve.engine.policies.caps import HostCaps, describe_caps
from hlserve.engine.scheduler import Scheduler
from hlserve.engine.sessions import Sessions, session_key
from hlserve.engine.spec_decode import SpecStats
from hlserve.errors import EngineDeadError, InvalidRequestError
from hlserve.models.model_config import ModelConfig
from hlserve.request import (
    FinishReason,
    Request,
    RequestClass,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    TokenLogprobs,
)
from hlserve.structured.grammar import GrammarCompiler, GrammarError, GrammarState
from hlserve.structured.thinking import ThinkingState
from hlserve.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("hlserve.engine")
class VirtualClock:
    """Simulated time: advanced by each step's predicted duration instead of the wall."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class Engine:
    """Built by ``engine/factory.py:build_engine``, which makes its parts from the config."""

    def __init__(self, config: EngineConfig, runner: Runner, scheduler: Scheduler,
                 tokenizer: Tokenizer | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.clock = clock
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.spec = scheduler.spec
        self.max_model_len = scheduler.max_model_len
        self.sessions = Sessions(config.session_ttl, config.session_ttl_policy)
        self._advance = getattr(clock, "advance", None)
        self.caps_report = describe_caps(config, HostCaps(
            f"hlserve engine caps (preset: {config.preset or 'none'}):", self.kv.num_pages,
            self.kv.page_size, self.max_model_len), self.scheduler.budget_controller)
        if self.spec is not None:
            self.caps_report += "\n  " + self.spec.describe()
        log.info("%s", self.caps_report)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._finished: list[Request] = []  # ended outside a step (aborts), reported next step
        self._counts = Counters()
        self.failures = FailureStreak()
        self.default_eos = frozenset(tokenizer.eos_token_ids if tokenizer
                                     else runner.model_config.eos_token_ids)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' grammar compiler, built on first use (indexing the vocabulary
        takes a second or two, which no unconstrained deployment should pay at start-up)."""
        if self._grammars is None:
            with self._grammars_lock:
                if self._grammars is None:
                    if self.tokenizer is None:
                        raise InvalidRequestError("structured outputs need a tokenizer; this "
                                                  "model has none")
                    closes = self.config.structured_outputs_config.closes_objects
                    self._grammars = GrammarCompiler(self.tokenizer.to_json(),
                                                     self.model_config.vocab_size,
                                                     self.default_eos, close_objects=closes)
        return self._grammars

    # ---- intake -------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        request_class: RequestClass | str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        follows: str | None = None,
        grammar: GrammarState | None = None,
        session_id: str | None = None,
        prompt_cache_key: str | None = None,
        user: str | None = None,
    ) -> Request:
        """One sequence. ``n`` > 1 is forked by the caller into sequences of
        ``params.for_sibling(i)``, each after the first naming it in ``follows`` (its
        leader), so that they share the prompt's pages through the prefix cache.
        ``grammar``: the matcher of ``params.structured_outputs``, compiled by the caller (the
        server compiles in its own threads: a spec too large to cache took a compile of up to
        a second here, on the engine thread, for every request that sent it).
        ``session_id`` / ``prompt_cache_key`` / ``user`` name its agent session
        (engine/sessions.py)."""
        params = params or SamplingParams()
        ids = self.check_request(prompt, params, compiled=grammar is not None)
        if params.num_sequences > 1:
            raise InvalidRequestError("a request of the engine is one sequence: fork n > 1 "
                                      "with params.for_sibling(i) and follows=")
        req = Request(
            prompt_token_ids=ids,
            params=params,
            request_class=RequestClass(request_class or self.config.default_request_class),
            priority=priority,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            eos_token_ids=self.default_eos,
            cache_salt=cache_salt,
            leader=self.requests.get(follows) if follows is not None else None,
            session=session_key(session_id, prompt_cache_key, user, cache_salt),
        )
        req.returning = req.session is not None and self.sessions.known(req.session)
        if params.structured_outputs is not None:
            req.grammar = grammar or self.grammars.state(params.structured_outputs)
        elif params.thinking is not None:
            req.thinking = ThinkingState(params.thinking, ids)
        if request_id is not None:
            if request_id in self.requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            req.request_id = request_id
        self.requests[req.request_id] = req
        if self.tokenizer is not None:
            self._detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, params.skip_special_tokens)
        self.scheduler.add(req)
        return req

    def check_request(self, prompt: str | Sequence[int], params: SamplingParams,
                      compiled: bool = False) -> list[int]:
        """The prompt's token ids if the engine would accept the request; raises
        :class:`InvalidRequestError` if not. Nothing is submitted (callers check a whole
        batch before adding any of it). ``compiled``: the caller compiled the grammar."""
        ids = self.prompt_ids(prompt)
        self.validate(ids, params, compiled)
        return ids

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt (text, or token ids) as checked token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send token ids")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        # one pass in C over types and the range; the per-token loop only names the culprit
        # (a 64K-token prompt would otherwise cost milliseconds of Python per request)
        if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= vocab):
            for t in ids:
                if type(t) is not int:
                    raise InvalidRequestError(f"a prompt is a string or a list of int token ids; got {t!r}")
                if not 0 <= t < vocab:
                    raise InvalidRequestError(f"token id {t!r} is not in the vocabulary [0, {vocab})")
        return ids

    def validate(self, ids: list[int], params: SamplingParams, compiled: bool = False) -> None:
        """Raises :class:`InvalidRequestError` if the engine cannot serve these ids/params."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate()  # again: a frozen dataclass can still be changed behind its back
        if params.structured_outputs is not None and not compiled:
            self.grammars.compile(params.structured_outputs)  # cached: add_request reuses it
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if params.logit_bias:
            vocab = self.model_config.vocab_size
            if bad := sorted(t for t in params.logit_bias if t >= vocab)[:5]:
                raise InvalidRequestError(f"logit_bias has token ids not in the vocabulary "
                                          f"[0, {vocab}): {bad}")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len}, which leaves no room for output"
            )
        # the one request that can never fit is the one the whole pool cannot hold
        peak = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.kv.pages_for(peak) > self.kv.num_pages:
            raise InvalidRequestError(
                f"the request needs up to {peak} tokens of KV cache; the pool holds "
                f"{self.kv.num_pages * self.kv.page_size}"
            )

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        self._finish(req, FinishReason.ABORT)
        return True

    # ---- read-only state: what the server's gauges and counters show ------------------
    @property
    def stats(self) -> EngineStats:
        """The counters and session retention now, as a snapshot (it does not change)."""
        c, kv = self._counts, self.kv
        return EngineStats(c.steps, c.prompt_tokens, c.generation_tokens, c.computed_tokens,
                           c.busy_time, c.failed_steps, kv.num_retained, kv.retained_hits,
                           kv.retained_expired, kv.retained_evicted,
                           self.sessions.stats.reprefilled_tokens)

    @property
    def num_steps(self) -> int:
        """``stats.steps`` without a snapshot: what a driver reads around every step."""
        return self._counts.steps

    @property
    def model_config(self) -> ModelConfig:
        """The model's config (vocabulary, context length, EOS ids), as the runner loaded it."""
        return self.runner.model_config

    @property
    def last_progress(self) -> float:
        """time.monotonic() of the forward's last sign of progress (a layer begun), read from
        another thread to tell a long step from a stuck one; 0.0: the runner reports none."""
        return self.runner.last_progress

    @property
    def virtual_time(self) -> bool:
        """Whether the clock is simulated (advanced by each step's predicted time)."""
        return self._advance is not None

    def skip_time(self, dt: float) -> None:
        """Jump a simulated clock ``dt`` seconds ahead (an idle gap of a simulation)."""
        if self._advance is None:
            raise RuntimeError("the engine runs on the wall clock: time cannot be skipped")
        self._advance(dt)

    @property
    def running(self) -> Sequence[Request]:
        """Running requests, in admission order (read them, do not change them)."""
        return self.scheduler.running

    @property
    def waiting(self) -> Sequence[Request]:
        """Requests waiting for admission (read them, do not change them)."""
        return self.scheduler.waiting

    @property
    def num_retractions(self) -> int:
        """Retractions (vLLM: preemptions) since start."""
        return self.scheduler.num_retractions

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool held by live requests (vLLM's ``kv_cache_usage_perc``)."""
        return self.kv.usage

    @property
    def kv_pool_tokens(self) -> int:
        return self.kv.num_pages * self.kv.page_size

    @property
    def kv_num_pages(self) -> int:
        """Pages in the KV pool (fixed at start: the simulator sizes its pool from it)."""
        return self.kv.num_pages

    @property
    def stage_switches(self) -> int | None:
        """Two-stage mixing's switches between its stages; None under another mixing policy."""
        return getattr(self.scheduler.mixing, "switches", None)

    @property
    def spec_stats(self) -> SpecStats | None:
        """Speculative decoding's running totals; None when it is off."""
        return self.spec.stats if self.spec is not None else None

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache since start (vLLM's meaning)."""
        return self.kv.prefix_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, tokens found cached."""
        return self.kv.prefix_hits

    def check_invariants(self) -> None:
        """Raises AssertionError if the KV accounting does not balance."""
        self.scheduler.check_invariants()

    def record_failed_step(self, exc: BaseException) -> None:
        """A step raised out of :meth:`step` in the loop that drives the engine: it counts
        towards the failure streak; raises :class:`EngineDeadError` once that is too long."""
        self.failures.record("engine steps", exc)

    # ---- the loop -----------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._finished)

    def step(self) -> list[RequestOutput]:
        """One iteration; returns outputs of requests that got a token or ended."""
        return [self._output_of(r) for r in self.step_requests()]

    def _output_of(self, req: Request) -> RequestOutput:
        """The request's output; one whose output cannot be built fails alone (its final
        output says so) instead of failing the whole step's outputs."""
        try:
            return RequestOutput.of(req)
        except Exception as exc:
            log.error("building the output of %s failed: %s", req.request_id, exc, exc_info=True)
            if not req.finished:
                self._finish(req, FinishReason.ERROR, error=f"building its output failed: {exc}")
            return RequestOutput(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                 token_ids=list(req.output_token_ids), text="", finished=True,
                                 finish_reason=FinishReason.ERROR.value,
                                 error=f"building its output failed: {type(exc).__name__}: {exc}")

    def step_requests(self) -> list[Request]:
        """One iteration; returns the requests that got a token or ended, themselves (read
        them, do not change them). For drivers that only look at finished requests: a
        snapshot of every running request per iteration is most of a simulator's time.

        A step that raises outside the runner (in ``schedule`` or ``update``) loses nothing:
        every request it touched ends with an error and is returned, every other one is kept,
        and the KV accounting is checked (:meth:`_recover`). Only repeated failures, or
        accounting that no longer balances, raise :class:`EngineDeadError`."""
        touched: list[Request] = self._finished
        self._finished = []
        if self.sessions.enabled:
            self.kv.expire(self.clock())
        try:
            batch = self.scheduler.schedule()
            for req in self.scheduler.rejected:
                self._finish(req, FinishReason.ABORT, error=(
                    f"rejected by admission ({self.config.admission}): its projected length "
                    f"({req.max_total_tokens} tokens) exceeds the KV headroom now"))
            self.scheduler.rejected.clear()
            if batch.seqs:
                self._run(batch, touched)
        except EngineDeadError:
            raise
        except Exception as exc:
            self._recover(exc, touched)
        if self.config.check_invariants:
            self.scheduler.check_invariants()
        return touched

    def _run(self, batch: Batch, touched: list[Request]) -> None:
        now = self.clock()
        for seq in batch.seqs:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
                if seq.request.session is not None and self.sessions.enabled:
                    self.sessions.on_admit(seq.request.session, seq.request.arrival_time,
                                           seq.request.num_cached_prompt)
        batch, result = self._execute_isolated(batch, touched)
        if not batch.seqs:
            return
        if self._advance is not None:
            self._advance(result.elapsed)
        self.scheduler.observe(batch, result.elapsed)
        self.sessions.observe(result.elapsed, batch.num_prefill_tokens)
        now = self.clock()
        self._counts.steps += 1
        self._counts.computed_tokens += batch.num_tokens
        self._counts.busy_time += result.elapsed
        if any(seq.draft for seq in batch.seqs):
            self.scheduler.update(batch, result.accepted)
        else:
            self.scheduler.update(batch)
        for seq in batch.seqs:
            if not seq.samples:
                continue
            req = seq.request
            try:
                if seq.draft:
                    self._append_verified(seq.request, seq.draft, result, now)
                else:
                    self._append(req, result.tokens[req.request_id], now,
                                 result.logprobs.get(req.request_id))
            except Exception as exc:  # one request's output processing: it fails alone
                # a grammar's lazy error is the request's spec, not a bug: no traceback
                log.error("processing the token of %s failed: %s", req.request_id, exc,
                          exc_info=not isinstance(exc, GrammarError))
                if not req.finished:
                    self._finish(req, FinishReason.ERROR, error=f"processing its output failed: {exc}")
            touched.append(req)

    def _execute_isolated(self, batch: Batch, touched: list[Request]) -> tuple[Batch, StepResult]:
        """Run the batch; if the forward raises, find the sequences it raises for by halving
        the batch, fail those alone and return the part that ran. Re-running a sequence
        rewrites the same KV slots with the same values, so a retry loses nothing. Only a
        forward that fails for every single sequence counts towards the runner being broken."""
        try:
            result = self.runner.execute(batch)
        except Exception as e:
            exc = e
        else:
            self.failures.reset()
            return batch, result
        ok, failed = bisect_forward(self.runner, batch.seqs, exc)
        self._counts.failed_steps += 1
        log.error("a forward failed; failing %d of its %d requests: %s", len(failed), len(batch),
                  exc, exc_info=True)
        for seq, err in failed:
            if not seq.request.finished:
                self._finish(seq.request, FinishReason.ERROR, error=f"the forward failed: {err}")
                touched.append(seq.request)
        if ok:
            self.failures.reset()
        else:
            self.failures.record("forwards", exc)
        return merge_runs(ok)

    def _recover(self, exc: Exception, touched: list[Request]) -> None:
        """A step raised outside the runner: end with an error every request the step was
        scheduling or running, and any request the half-done step left inconsistent (pages
        held while waiting, running without pages, in neither queue), so that each gets its
        final output and nothing holds pages; then the accounting must balance."""
        log.error("an engine step failed outside the forward: %s", exc, exc_info=True)
        self._counts.failed_steps += 1
        sched = self.scheduler
        victims = stranded_requests(sched, self.kv, self.requests)
        sched.rejected.clear()
        for req in victims.values():
            if not req.finished:
                try:
                    self._finish(req, FinishReason.ERROR,
                                 error=f"the engine step failed: {type(exc).__name__}: {exc}")
                except Exception:  # its state is beyond repair; the check below decides
                    log.exception("ending %s after a failed step failed", req.request_id)
                    req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.ERROR
                    self.requests.pop(req.request_id, None)
            if req in self._finished:
                self._finished.remove(req)
            if req not in touched:
                touched.append(req)
        sched.reset_pass()
        try:
            sched.check_invariants()
        except AssertionError as broken:
            raise EngineDeadError(f"the KV accounting is broken after a failed step ({exc}): "
                                  f"{broken}") from exc
        self.failures.record("engine steps", exc)

    def _append_verified(self, req: Request, draft: list[int], result: StepResult,
                         now: float) -> None:
        """A speculating request's accepted drafts and its one more token, appended one by
        one: the request ends at the exact token that ends it (the rest are dropped), then
        the pages of rejected drafts go back."""
        accepted = result.accepted.get(req.request_id, [])
        assert self.spec is not None
        self.spec.record(len(draft), len(accepted))
        for token in (*accepted, result.tokens[req.request_id]):
            self._append(req, token, now)
            if req.finished:
                return
        self.scheduler.settle_draft(req)

    def _append(self, req: Request, token: int, now: float,
                logprobs: TokenLogprobs | None = None) -> None:
        req.output_token_ids.append(token)
        # a complete grammar ends the request: nothing more could be accepted
        grammar_done = req.grammar is not None and req.grammar.advance(token)
        req.token_times.append(now)
        if req.params.logprobs is not None:
            # a runner that computes none (the simulator) leaves a neutral entry, so the list
            # stays one per token
            req.output_logprobs.append(logprobs or TokenLogprobs(0.0))
        if req.first_token_time is None:
            req.first_token_time = now
        p = req.params
        n_out = len(req.output_token_ids)
        detok = self._detok.get(req.request_id)
        delta = ""
        # special tokens kept in the text (tools present): the token that ends the reply is
        # still not part of it, as vLLM leaves its stop tokens out
        ends_here = n_out >= p.min_tokens and (token in p.stop_token_ids or (
            not p.ignore_eos and token in req.eos_token_ids))
        if detok is not None and (p.skip_special_tokens or not ends_here):
            delta = detok.add(token)
            req.output_text = detok.text
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                req.stop_reason = token
                return self._finish(req, FinishReason.STOP)
            if not p.ignore_eos and token in req.eos_token_ids:
                return self._finish(req, FinishReason.STOP)
            if p.stop and detok is not None and self._check_stop_strings(req, detok, delta):
                return self._finish(req, FinishReason.STOP)
        if grammar_done:
            return self._finish(req, FinishReason.STOP)
        if n_out >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return self._finish(req, FinishReason.LENGTH)
        if detok is not None and p.stop and not p.include_stop_str_in_output:
            # hold back what could be the start of a stop string: if it completes, the text
            # is cut before it, and streamed text must never be taken back
            hold = max(len(s) for s in p.stop) - 1
            req.output_text = detok.text[: max(0, len(detok.text) - hold)]

    def _check_stop_strings(self, req: Request, detok: IncrementalDetokenizer, delta: str) -> bool:
        if not delta:
            return False
        text = detok.text
        longest = max(len(s) for s in req.params.stop)
        window_start = max(0, len(text) - len(delta) - longest + 1)
        hits = [(i, s) for s in req.params.stop if (i := text.find(s, window_start)) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        req.output_text = text[: i + len(s)] if req.params.include_stop_str_in_output else text[:i]
        req.stop_reason = s
        return True

    def _retain_until(self, req: Request, reason: FinishReason) -> float | None:
        """The retention deadline of a finished session round's pages (None: plain)."""
        if (req.session is None or not self.sessions.enabled or reason is FinishReason.ABORT
                or not self.kv.holds(req.request_id)):
            return None
        return self.sessions.retain_until(req.session, self.clock(), req.num_computed,
                                          len(self.kv.page_table(req.request_id)),
                                          self.kv.num_pages)

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        # a speculating request ended inside its accepted drafts: its KV is valid up to the
        # last token it kept (Scheduler.update counted all the accepted ones)
        req.num_computed = min(req.num_computed, req.num_tokens)
        if self.spec is not None:
            self.spec.finish(req.request_id)
        self.scheduler.remove(req, self._retain_until(req, reason))
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        req.finish_time = self.clock()
        detok = self._detok.pop(req.request_id, None)
        if detok is not None and not isinstance(req.stop_reason, str):  # a stop string cut it
            detok.flush()
            req.output_text = detok.text
        self.runner.release(req.request_id)
        self.requests.pop(req.request_id, None)
        self._counts.prompt_tokens += req.num_prompt_tokens
        self._counts.generation_tokens += len(req.output_token_ids)
        if reason is FinishReason.ABORT:
            self._finished.append(req)
