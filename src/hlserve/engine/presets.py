"""Presets: the systems we compare against, and our throughput mode, as knob settings.

Every number here comes from the systems' own documented defaults (SGLang 0.5.x, vLLM's
V1 engine, Sarathi-Serve's paper), so that a result can say which system's policy it ran. A preset fills in knobs; any knob
the caller names explicitly wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cpu" or "cuda"
    memory_gib: float | None = None  # accelerator memory; None on CPU
    hopper_class: bool = False  # compute capability >= 9 (H100/H200/H20)

    @classmethod
    def detect(cls, device: str = "auto") -> DeviceInfo:
        import torch

        if device == "cpu" or not torch.cuda.is_available():
            return cls("cpu")
        idx = torch.device(device if device not in ("auto", "cuda") else "cuda:0").index or 0
        props = torch.cuda.get_device_properties(idx)
        return cls("cuda", props.total_memory / 2**30, props.major >= 9)


def sglang_chunk_size(dev: DeviceInfo) -> int:
    """SGLang's --chunked-prefill-size by GPU memory; CPUs get the smallest tier."""
    mem = dev.memory_gib
    if mem is None or mem < 35:
        return 2048
    if mem < 60:
        return 4096
    return 8192 if mem < 160 else 16384


def vllm_token_budget(dev: DeviceInfo) -> int:
    """vLLM's online max_num_batched_tokens: 8192 on H100-class, 2048 on A100, smaller, CPU."""
    return 8192 if dev.hopper_class else 2048


# the systems we compare against apply their caps to every request alike
_NO_CLASSES: dict[str, Any] = {"interactive_chunk_size": None, "interactive_token_budget": None}


def preset_options(name: str, dev: DeviceInfo) -> dict[str, Any]:
    if name == "sglang":
        return dict(
            mixing="prefill_first", chunk_size=sglang_chunk_size(dev), token_budget=None,
            max_prefill_tokens=16384, max_chunked_prefills=1, order="lpm",
            lpm_fcfs_fallback=128, lpm_aging=0.0, admission="reserve", defer_shared_prefill=True,
            retraction="fewest_generated", budget_controller="fixed", prefill_delay=None,
            **_NO_CLASSES,
        )
    if name == "vllm":
        budget = vllm_token_budget(dev)
        return dict(
            mixing="always", chunk_size=None, token_budget=budget, order="fcfs",
            admission="chunk", retraction="lifo", budget_controller="fixed",
            max_num_seqs=1024 if dev.hopper_class else 256, prefill_delay=None,
            **_NO_CLASSES,
        )
    if name in ("sarathi", "sarathi-relaxed"):
        c = 512 if name == "sarathi" else 2048
        return dict(
            mixing="always", chunk_size=c, token_budget=c, order="fcfs", admission="chunk",
            retraction="lifo", budget_controller="fixed", prefill_delay=None,
            **_NO_CLASSES,
        )
    if name == "hlserve":
        # throughput mode: the latency caps off (chunk size, token budget, prefill delay), the
        # safety caps kept (running requests, KV pool, model length)
        return dict(
            mixing="two_stage", chunk_size=None, token_budget=None, budget_controller="ema",
            order="lpm", lpm_fcfs_fallback=None, lpm_aging=4.0, admission="backpressure",
            defer_shared_prefill=True,
            retraction="fewest_generated", prefill_delay=None, max_chunked_prefills=None,
            max_prefill_tokens=None,
            # with --speculative-config: k per step from acceptance and step cost
            speculative_adaptive=True,
        )
    raise ValueError(f"unknown preset {name!r}: {', '.join(PRESETS)}")


PRESETS = ("sglang", "vllm", "sarathi", "sarathi-relaxed", "hlserve")
MODES = {"throughput": "hlserve", "slo": "vllm"}


def preset_knobs(mode: str | None, preset: str | None, device: str = "auto",
                 dev: DeviceInfo | None = None) -> dict[str, Any]:
    """The knobs a ``mode`` or ``preset`` fills in, and ``preset``: its name (none of either:
    no knobs), for ``dev`` (detected for the ``device`` option when None). The options given
    are laid over them by whoever makes the config (engine/args.py:make_config)."""
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: {', '.join(MODES)}")
        if preset is not None and preset != MODES[mode]:
            raise ValueError(f"mode {mode!r} is preset {MODES[mode]!r}, not {preset!r}")
        preset = MODES[mode]
    if preset is None:
        return {}
    return {**preset_options(preset, dev or DeviceInfo.detect(device)), "preset": preset}


def resolve_options(options: dict[str, Any], dev: DeviceInfo | None = None) -> dict[str, Any]:
    """Expand ``mode`` / ``preset`` into knobs, the options given laid over the preset's: a
    key present is explicit whatever its value, so ``chunk_size=None`` (``--chunk-size none``)
    removes a preset's cap, and a knob left out keeps it."""
    opts = dict(options)
    mode = opts.pop("mode", None)
    preset = opts.pop("preset", None)
    return {**preset_knobs(mode, preset, opts.get("device", "auto"), dev), **opts}

