"""Engine configuration: one frozen dataclass (the knobs named as vLLM and SGLang name them,
where they have them), its typed speculative-decoding field (:class:`SpeculativeConfig`,
vLLM's ``--speculative-config``), and :func:`parse_cap`, the one reader of a cap's value from
outside.

The policy knobs' names (``order``, ``mixing``, ...) are not listed here: each policy module
owns the registry of its names (``hlserve.engine.policies``), and this module sits below
``engine/``, so it cannot read them. A config's policy names are checked against those
registries by ``engine/policies/names.py:check_policy_names`` wherever a config is made or
built into an engine (``engine/args.py:make_config``, ``engine/factory.py:build_engine``, the
vLLM plugin's options)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hlserve.errors import InvalidRequestError
from hlserve.request import REQUEST_CLASSES
from hlserve.structured.strict import StructuredOutputsConfig

# the size knobs whose None means "no cap" (the other optional ints mean "derive it": num_pages
# from kv_cache_gb, max_model_len from the model, budget_max from the KV pool)
CAP_KNOBS = ("chunk_size", "token_budget", "prefill_delay", "max_prefill_tokens",
             "max_chunked_prefills", "lpm_fcfs_fallback", "interactive_chunk_size",
             "interactive_token_budget")
# the words a cap takes for "no cap" outside Python: on every command line, in the plugin's
# options and in a sweep's --chunk-sizes
NO_CAP_WORDS = ("none", "unlimited", "inf", "off")


def parse_cap(value: str | int | None) -> int | None:
    """A cap's value from outside (a flag, an environment variable, a JSON option): a positive
    int, or None for "no cap", spelled None or one of :data:`NO_CAP_WORDS`. Inside, "no cap"
    is None and nothing else."""
    if value is None or (isinstance(value, str) and value.strip().lower() in NO_CAP_WORDS):
        return None
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        n = int(value)
    if n is None or n < 1:
        raise ValueError(f"expected a positive integer or one of {', '.join(NO_CAP_WORDS)}, "
                         f"got {value!r}")
    return n


SPECULATIVE_METHODS = ("ngram", "suffix")
_SPECULATIVE_FIELDS = {
    "method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
    "suffix_decoding_max_cached_bytes",
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative-config fields that hlserve takes (the ngram and suffix methods;
    engine/speculation.py has their speculators)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 2
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # hlserve's own field (vLLM bounds its tree by request count alone): the shared index of
    # finished outputs held to this many bytes of arrays (16 per token), oldest evicted first
    suffix_decoding_max_cached_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequestError(
                f"speculative method {self.method!r} is not supported: hlserve has "
                f"{SPECULATIVE_METHODS} (no draft model)")
        if self.num_speculative_tokens < 1:
            raise InvalidRequestError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidRequestError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_spec_factor <= 0:
            raise InvalidRequestError("suffix_decoding_max_tree_depth and _max_spec_factor "
                                      "must be positive")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise InvalidRequestError("suffix_decoding_min_token_prob must be in [0, 1]")
        if isinstance(self.suffix_decoding_max_cached_bytes, bool) \
                or not isinstance(self.suffix_decoding_max_cached_bytes, int) \
                or self.suffix_decoding_max_cached_bytes < 0:
            raise InvalidRequestError("suffix_decoding_max_cached_bytes must be an integer >= 0 "
                                      "(0: no index of finished outputs)")

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any]) -> SpeculativeConfig:
        """From the flag's JSON text or ``LLM(speculative_config=dict)``; unknown fields refused."""
        data = json.loads(spec) if isinstance(spec, str) else dict(spec)
        if not isinstance(data, dict):
            raise InvalidRequestError("speculative config must be a JSON object")
        unknown = sorted(set(data) - _SPECULATIVE_FIELDS)
        if unknown:
            raise InvalidRequestError(f"speculative config fields not supported: {unknown}")
        if "method" not in data or "num_speculative_tokens" not in data:
            raise InvalidRequestError("speculative config needs method and num_speculative_tokens")
        if data["method"] == "ngram" and "prompt_lookup_min" in data \
                and "prompt_lookup_max" not in data:
            # vLLM: one bound given sets the other to it.
            data["prompt_lookup_max"] = data["prompt_lookup_min"]
        if data["method"] == "ngram" and "prompt_lookup_max" in data \
                and "prompt_lookup_min" not in data:
            data["prompt_lookup_min"] = data["prompt_lookup_max"]
        return cls(**data)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto (cuda if present) | cpu | cuda | cuda:N
    seed: int = 0
    # torch intra-op threads on a CPU (process-wide; None: torch's choice). On a machine
    # other jobs share, one thread can be several times faster than oversubscribed OpenMP.
    cpu_threads: int | None = None
    # KV pool (safety caps)
    page_size: int = 16
    num_pages: int | None = None  # overrides kv_cache_gb
    kv_cache_gb: float = 2.0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256  # running-request limit
    enable_prefix_caching: bool = True
    max_prefill_tokens: int | None = None  # prefill tokens per iteration (SGLang's cap)
    # tokens per iteration bounded so that a step takes about this many seconds, from the
    # measured time per token (policies/budget.py:StepTimeCap): no request can hold the engine
    # for minutes. None: off (the simulator and the offline API; `hlserve serve` sets it)
    max_step_seconds: float | None = None
    # latency caps
    chunk_size: int | None = None  # None: a prompt is prefilled in one pass
    token_budget: int | None = None  # tokens per iteration (vLLM's max_num_batched_tokens); None: no cap
    prefill_delay: int | None = None  # admit new prefill at most every N iterations while decoding
    max_chunked_prefills: int | None = None  # requests mid-chunk at once (SGLang: 1)
    # policies
    budget_controller: str = "fixed"
    mixing: str = "always"
    order: str = "fcfs"
    admission: str = "chunk"
    retraction: str = "fewest_generated"
    # policy parameters
    lpm_fcfs_fallback: int | None = None  # LPM becomes FCFS above this many waiting (SGLang: 128)
    lpm_aging: float = 0.0  # tokens of "virtual prefix" a request earns per iteration it waits
    # admission=reserve: a running request with ignore_eos reserves its whole remaining output,
    # not the new-token ratio of it (SGLang 0.5.23: "fixed-length requests cannot benefit from
    # the early-EOS estimate"); off keeps the stored study's preset (docs/fidelity.md)
    reserve_fixed_length_in_full: bool = False
    # order=program (policies/order.py:ProgramOrder): a request that has waited this many
    # iterations goes ahead of every class, so a new session is never starved by the next
    # rounds of started ones
    program_aging_steps: int = 256
    defer_shared_prefill: bool = False  # hold a request whose uncached prefix is being prefilled
    two_stage_high: float = 0.90  # KV use that (with pending prefill > evictable) enters decode-only
    two_stage_low: float = 0.70  # KV use below which mixing resumes
    ema_alpha: float = 0.1
    budget_warmup: int = 10  # iterations the budget controllers ignore at start
    budget_min: int = 256  # the EMA controller's floor
    budget_max: int | None = None  # its ceiling (None: the KV pool), independent of the start
    # request classes: latency caps applied only where an interactive request would feel them
    default_request_class: str = "agent"
    interactive_chunk_size: int | None = 512
    interactive_token_budget: int | None = 2048
    # which preset filled the knobs in (for the start-up log)
    preset: str | None = None
    # agent sessions (engine/sessions.py): a finished round's pages are retained this many
    # seconds (evicted after plain cached pages); None: off, releases as before
    session_ttl: float | None = None
    session_ttl_policy: str = "fixed"  # fixed | learned (per session, from its tool gaps)
    # retained pages are not evicted to admit a new session's first round (or a request of no
    # session) while other requests run: Continuum's pinning; off: retention yields to any
    # admission (engine/sessions.py)
    session_hold: bool = False
    # speculative decoding (engine/spec_decode.py): vLLM's --speculative-config, parsed once
    # where it comes in (the flag, engine/args.py:make_config for JSON text or a dict). None: off
    speculative_config: SpeculativeConfig | None = None
    # k chosen per step from measured acceptance and step cost (engine/spec_adaptive.py);
    # False: num_speculative_tokens every step. Throughput mode's preset turns it on
    speculative_adaptive: bool = False
    # structured outputs (structured/strict.py): vLLM's --structured-outputs-config, parsed
    # once where it comes in; the default reads JSON schemas as vLLM's default backend does
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig)
    # checking: verify KV accounting after every step (tests turn this on)
    check_invariants: bool = False

    def __post_init__(self) -> None:
        for name in ("page_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("cpu_threads", "chunk_size", "token_budget", "num_pages", "max_model_len",
                     "prefill_delay",
                     "max_prefill_tokens", "max_chunked_prefills", "lpm_fcfs_fallback",
                     "budget_max", "interactive_chunk_size", "interactive_token_budget"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or unset, got {value}")
        # the policy knobs' names: engine/policies/names.py (see the module's docstring)
        if self.default_request_class not in REQUEST_CLASSES:
            raise ValueError(f"default_request_class must be one of {REQUEST_CLASSES}, got "
                             f"{self.default_request_class!r}")
        if self.speculative_config is not None \
                and not isinstance(self.speculative_config, SpeculativeConfig):
            raise TypeError("speculative_config must be a SpeculativeConfig (engine/args.py:"
                            f"make_config parses JSON text or a dict), got "
                            f"{type(self.speculative_config).__name__}")
        if not isinstance(self.structured_outputs_config, StructuredOutputsConfig):
            raise TypeError("structured_outputs_config must be a StructuredOutputsConfig "
                            "(engine/args.py:make_config parses JSON text or a dict)")
        if not 0 < self.two_stage_low < self.two_stage_high <= 1:
            raise ValueError("need 0 < two_stage_low < two_stage_high <= 1")
        if not 0 < self.ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        # the plugin's options are an EngineConfig too, so these are its checks as well
        if self.budget_min < 1:
            raise ValueError(f"budget_min must be >= 1, got {self.budget_min}")
        if self.budget_warmup < 0:
            raise ValueError(f"budget_warmup must be >= 0, got {self.budget_warmup}")
        if self.max_step_seconds is not None and not self.max_step_seconds > 0:
            raise ValueError(f"max_step_seconds must be > 0 or unset, got {self.max_step_seconds}")
        if self.session_ttl is not None and not self.session_ttl > 0:
            raise ValueError(f"session_ttl must be > 0 or unset, got {self.session_ttl}")
        if self.session_ttl_policy not in ("fixed", "learned"):
            raise ValueError(f"session_ttl_policy must be fixed or learned, got "
                             f"{self.session_ttl_policy!r}")
        if self.program_aging_steps < 1:
            raise ValueError(f"program_aging_steps must be >= 1, got {self.program_aging_steps}")
        if not self.lpm_aging >= 0:  # NaN included
            raise ValueError(f"lpm_aging must be >= 0, got {self.lpm_aging}")

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}
