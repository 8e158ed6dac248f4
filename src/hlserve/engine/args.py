"""Engine flags, their defaults and their parsing, below every command line: the one place
that turns ``--preset vllm --chunk-size none ...`` or ``LLM(..., preset="vllm")`` options into
an :class:`EngineConfig` (:func:`make_config`: presets expanded for a device, explicit knobs
winning).

A flag's text becomes its typed value once, where argparse reads it (:func:`cap_flag` for a
cap, :func:`parse_speculative_config` for ``--speculative-config``,
:func:`parse_structured_outputs_config` for ``--structured-outputs-config``); from there the value
travels unchanged into the config. An option is explicit when its key is present, whatever
its value: a flag not given is absent from the namespace (``argparse.SUPPRESS``), a flag given
``none`` is None, and None laid over a preset's cap removes it. In Python the same holds for a
keyword passed, None included."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from typing import Any

from hlserve.config import (
    CAP_KNOBS,
    NO_CAP_WORDS,
    REQUEST_CLASSES,
    EngineConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    parse_cap,
)
from hlserve.engine.policies.names import check_policy_names, policy_names
from hlserve.engine.presets import MODES, PRESETS, DeviceInfo, preset_knobs
from hlserve.errors import InvalidRequestError

# engine option -> (flag, help); vLLM's flag names where vLLM has the same knob
ENGINE_FLAGS: dict[str, tuple[list[str], str]] = {
    "dtype": (["--dtype"], "auto | float32 | bfloat16 | float16"),
    "device": (["--device"], "auto | cpu | cuda | cuda:N"),
    "seed": (["--seed"], "seed of the sampler for requests without their own seed"),
    "cpu_threads": (["--cpu-threads"], "torch threads on a CPU (unset: torch's choice)"),
    "page_size": (["--page-size", "--block-size"], "tokens per KV page"),
    "num_pages": (["--num-pages", "--num-gpu-blocks-override"], "KV pool size in pages"),
    "kv_cache_gb": (["--kv-cache-gb"], "KV pool size in GiB (when --num-pages is unset)"),
    "max_model_len": (["--max-model-len"], "longest sequence (prompt + output)"),
    "max_num_seqs": (["--max-num-seqs"], "running-request limit"),
    "chunk_size": (["--chunk-size"],
                   "prefill chunk size; 'none': unchunked, also over a preset's value"),
    "token_budget": (["--token-budget", "--max-num-batched-tokens"],
                     "tokens per iteration; 'none': unlimited, also over a preset's value"),
    "max_prefill_tokens": (["--max-prefill-tokens"], "prefill tokens per iteration"),
    "max_step_seconds": (["--max-step-seconds"],
                         "safety cap: tokens per iteration bounded so a step takes about this "
                         "many seconds, from the measured time per token; 'none': off "
                         "(hlserve serve's default: 1)"),
    "prefill_delay": (["--prefill-delay"], "admit new prefill at most every N iterations"),
    "max_chunked_prefills": (["--max-chunked-prefills"], "requests mid-chunk at once"),
    # a policy's names are its module's registry's (engine/policies/names.py), checked by
    # make_config like a keyword's: a sweep point with a bad name fails alone, not the sweep
    "budget_controller": (["--budget-controller"], " | ".join(policy_names("budget_controller"))),
    "mixing": (["--mixing"], " | ".join(policy_names("mixing"))),
    "order": (["--order", "--schedule-policy"], " | ".join(policy_names("order"))),
    "admission": (["--admission"], " | ".join(policy_names("admission"))),
    "retraction": (["--retraction"], " | ".join(policy_names("retraction"))),
    "lpm_aging": (["--lpm-aging"], "LPM aging, tokens per iteration waited"),
    "program_aging_steps": (["--program-aging-steps"], "--order program: a request waiting "
                            "this many iterations joins the next rounds of started "
                            "sessions (ahead of new ones)"),
    "session_ttl": (["--session-ttl"], "seconds an agent session's pages are retained after "
                    "a round (evicted after plain cached pages); 'none': off"),
    "session_ttl_policy": (["--session-ttl-policy"], "fixed | learned (per session, from its "
                           "tool gaps and the prefill cost of its context)"),
    "session_hold": (["--session-hold"], "on: a new session's first round (or a request of "
                     "no session) does not evict retained pages while other requests run "
                     "(Continuum's pinning); off: retention yields to every admission"),
    "speculative_config": (["--speculative-config"], "speculative decoding, vLLM's JSON: "
                           "'{\"method\": \"ngram\" | \"suffix\", \"num_speculative_tokens\": k, "
                           "...}' (no draft model); suffix also takes vLLM's "
                           "suffix_decoding_* keys and suffix_decoding_max_cached_bytes "
                           "(its index's byte budget, default 64 MiB)"),
    "speculative_adaptive": (["--speculative-adaptive"], "on: k chosen per step (0..k) from "
                             "the measured acceptance per position and step cost; off: "
                             "num_speculative_tokens every step (throughput mode: on)"),
    "structured_outputs_config": (["--structured-outputs-config"], "vLLM's JSON: "
                                  "'{\"backend\": \"auto\" | \"guidance\", "
                                  "\"disable_additional_properties\": bool}'; auto: a schema's "
                                  "omitted additionalProperties means false (vLLM's default "
                                  "backend); guidance: JSON Schema's permissive reading"),
    "lpm_fcfs_fallback": (["--lpm-fcfs-fallback"], "LPM falls back to FCFS above this many waiting"),
    "reserve_fixed_length_in_full": (["--reserve-fixed-length-in-full"], "admission=reserve: "
                                     "an ignore_eos request's remaining output is reserved in "
                                     "full (SGLang 0.5.23), not at the new-token ratio"),
    "budget_min": (["--budget-min"], "EMA budget floor"),
    "budget_max": (["--budget-max"], "EMA budget ceiling (default: the KV pool)"),
    "default_request_class": (["--default-request-class"], " | ".join(REQUEST_CLASSES)),
    "interactive_chunk_size": (["--interactive-chunk-size"], "chunk while interactive traffic waits"),
    "interactive_token_budget": (
        ["--interactive-token-budget"], "iteration budget while interactive traffic decodes"
    ),
}
STR_KNOBS = {"dtype", "device", "mixing", "order", "retraction", "admission",
             "budget_controller", "default_request_class", "session_ttl_policy"}
# where add_engine_args puts each flag in the namespace
FLAG_DESTS = (*ENGINE_FLAGS, "enable_prefix_caching", "mode", "preset")
# every option name an engine takes: the config's fields, and the two that expand into them
OPTION_NAMES = frozenset(EngineConfig.field_names() - {"model"}) | {"mode", "preset"}


def cap_flag(text: str) -> int | None:
    """A cap flag's value (:func:`hlserve.config.parse_cap`), refused as argparse refuses:
    the one place a cap's text becomes its int (or None, no cap)."""
    try:
        return parse_cap(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seconds(text: str) -> float | None:
    """A duration flag's value: seconds > 0, or None for one of NO_CAP_WORDS."""
    if text.strip().lower() in NO_CAP_WORDS:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected seconds > 0 or one of "
                                         f"{', '.join(NO_CAP_WORDS)}, got {text!r}")
    return value


def parse_speculative_config(spec: Any) -> SpeculativeConfig | None:
    """vLLM's speculative config (JSON text, a dict or a :class:`SpeculativeConfig`; None or a
    no-cap word: off), parsed and checked once where it comes in; ValueError saying what is
    wrong if it is not one."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in NO_CAP_WORDS):
        return None
    if isinstance(spec, SpeculativeConfig):
        return spec
    try:
        return SpeculativeConfig.parse(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON ({e}): {spec!r}") from None
    except (InvalidRequestError, TypeError) as e:
        raise ValueError(f"--speculative-config: {e}") from None


def parse_structured_outputs_config(spec: Any) -> StructuredOutputsConfig:
    """vLLM's structured outputs config (JSON text, a dict or a
    :class:`StructuredOutputsConfig`), parsed and checked once where it comes in; ValueError
    saying what is wrong (a start-up error) if hlserve does not implement what it asks."""
    if isinstance(spec, StructuredOutputsConfig):
        return spec
    try:
        return StructuredOutputsConfig.parse(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"--structured-outputs-config is not valid JSON ({e}): "
                         f"{spec!r}") from None
    except (InvalidRequestError, TypeError) as e:
        raise ValueError(f"--structured-outputs-config: {e}") from None


def _structured_flag(text: str) -> StructuredOutputsConfig:
    try:
        return parse_structured_outputs_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _speculative_flag(text: str) -> SpeculativeConfig | None:
    try:
        return parse_speculative_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def on_off(text: str) -> bool:
    """A switch flag's value: on/true/yes/1 or off/false/no/0."""
    word = text.strip().lower()
    if word in ("on", "true", "yes", "1"):
        return True
    if word in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def _flag_type(name: str, default: Any) -> Any:
    if name == "speculative_config":
        return _speculative_flag
    if name == "structured_outputs_config":
        return _structured_flag
    if isinstance(default, bool):
        return on_off
    if name in ("max_step_seconds", "session_ttl"):
        return seconds
    if name in CAP_KNOBS:
        return cap_flag
    if name in STR_KNOBS:
        return str
    return {"int": int, "float": float, "str": str}.get(type(default).__name__, int)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags on ``parser``; a flag not given is absent from the namespace, so that
    only the flags given reach :func:`engine_options` and a preset fills in the rest."""
    group = parser.add_argument_group("engine")
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name, (flags, help_text) in ENGINE_FLAGS.items():
        default = fields[name].default
        shown = "none" if default is None and name in CAP_KNOBS else default
        if isinstance(default, bool):
            shown = "on" if default else "off"
        if name == "structured_outputs_config":
            shown = '{"backend": "auto"}'
        if name in CAP_KNOBS and "'none'" not in help_text:
            help_text += "; 'none': no cap"
        group.add_argument(*flags, dest=name, type=_flag_type(name, default),
                           default=argparse.SUPPRESS, help=f"{help_text} (default: {shown})")
    group.add_argument("--mode", choices=list(MODES), default=argparse.SUPPRESS,
                       help="throughput: hlserve's throughput mode; slo: a production default (vllm)")
    group.add_argument("--preset", choices=list(PRESETS), default=argparse.SUPPRESS,
                       help="the knob settings of a system we compare against")
    group.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", default=argparse.SUPPRESS,
                       help="turn the radix prefix cache off")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags that were given, a cap given ``none`` as None."""
    return {n: getattr(args, n) for n in FLAG_DESTS if hasattr(args, n)}


@functools.cache
def _engine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine-args", add_help=False)
    add_engine_args(p)
    return p


def parse_engine_args(argv: Sequence[str]) -> dict[str, Any]:
    """Engine flags given as a list (``--engine-args``, a sweep point's flags) as options."""
    return engine_options(_engine_parser().parse_args(list(argv)))


def check_options(options: dict[str, Any]) -> None:
    unknown = set(options) - OPTION_NAMES
    if unknown:
        raise TypeError(f"unknown engine option(s) {sorted(unknown)}; known: {sorted(OPTION_NAMES)}")


def make_config(model: str, *, device_info: DeviceInfo | None = None,
                **options: Any) -> EngineConfig:
    """The one maker of an engine's config: the options given (flags as argparse typed them,
    or Python keywords) laid over the knobs of their ``mode`` / ``preset`` (for
    ``device_info``, detected from the ``device`` option when None), every option given
    winning, None included. A speculative config given as JSON text or a dict is parsed here;
    the policy names are checked against their registries."""
    check_options(options)
    given = {k: v for k, v in options.items() if k not in ("mode", "preset")}
    if "speculative_config" in given:
        given["speculative_config"] = parse_speculative_config(given["speculative_config"])
    if "structured_outputs_config" in given:
        given["structured_outputs_config"] = parse_structured_outputs_config(
            given["structured_outputs_config"])
    knobs = preset_knobs(options.get("mode"), options.get("preset"),
                         options.get("device", "auto"), device_info)
    config = EngineConfig(model=str(model), **{**knobs, **given})
    check_policy_names(config)
    return config
