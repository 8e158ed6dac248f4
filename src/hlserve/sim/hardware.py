"""Hardware profiles: what one device can do, and how efficiently real kernels use it.

A profile is peak numbers (the vendors' datasheets: dense BF16, no sparsity) plus efficiency terms. The efficiency terms are
fitted to measurements where measurements exist, and every value says where it came from:

- GEMM and elementwise efficiency, kernel time: fitted to Vidur's operator profiles of H100
  and A100 (``fitting.py``; refit with ``python -m hlserve.sim.fitting``). H20 and H200 take
  the H100 fit (same Hopper SM and kernels), L40S the A100 fit (nearest profiled tensor-core
  generation); with ``n_half`` tied to each device's own ridge point (see ``fitting.py``).
- All-reduce alpha-beta: fitted to Vidur's NCCL profiles on H100 and A100 DGX nodes (2, 4, 8
  GPUs). H20 and H200 (NVLink 900 GB/s, like H100) take the H100 fit; L40S (PCIe Gen4, 64 GB/s)
  the A100 fit with bandwidth scaled by 64/600.
- Attention efficiency and the per-iteration overhead are **assumptions**, not fits: no
  profile of them is in ``data/``. Prefill attention at 55% of peak (FlashAttention-2/3 reach
  50-75% of peak on long sequences), decode attention at 70% of HBM bandwidth (paged decode
  kernels on long contexts), 1 ms scheduler/sampling overhead per iteration plus 10 us per
  sequence, 4 us to launch a kernel outside a CUDA graph, decode graphs up to batch 256.
  ``hlserve calibrate`` measures all of these on the machine at hand instead.
- ``attn_len_half`` and ``allreduce_alpha`` are corrections fitted on public measurements by
  ``benchmarks/fidelity.py`` (docs/fidelity.md); they default to 0 and () (off), which keeps
  the terms above exactly as they are. The suite's other correction, decode attention at ~92%
  of HBM bandwidth, is a value of ``attn_eta_mem``, not a new term; the shipped 70% stays
  until the study is rerun on it. ``allreduce_alpha`` holds an engine's measured all-reduce
  latency per device count in place of the Vidur fit's (timed from Python, 45-50 us on A100);
  the suite fits TurboMind's on its one-client rows, and docs/study.md section 5 measures
  what it would move in the study.

Memory sizes in the datasheets ("96 GB") are taken as GiB: HBM stacks are binary-sized.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense FLOP/s of one device at the profile's dtype
    mem_bw: float  # bytes/s of device memory
    mem_gib: float  # device memory
    link_bw: float  # bytes/s per device to its peers (NVLink, PCIe)
    arch: str = "hopper"  # hopper | ampere | ada | cpu (presets key some defaults on it)
    dtype_bytes: int = 2  # weights, activations and KV (bf16 on GPUs)
    # GEMM: t = max(F / (eta_c(n) * peak), bytes / (gemm_eta_mem * BW)) + kernel_time,
    # eta_c(n) = gemm_eta_max * n / (n + gemm_ridge_frac * ridge)
    gemm_eta_max: float = 0.75
    gemm_ridge_frac: float = 0.55
    gemm_eta_mem: float = 0.85
    kernel_time: float = 6e-6  # fixed time of one kernel on the device
    elem_eta_mem: float = 0.5  # norms, rope, activation, residual adds
    elem_kernel_time: float = 2e-6
    attn_eta_compute: float = 0.55  # prefill attention, of peak
    attn_eta_mem: float = 0.70  # decode attention (KV reads), of BW
    # a correction fitted on public measurements (benchmarks/fidelity.py); 0 keeps the term
    # above exactly as it is. Prefill attention efficiency rises with a segment's length:
    # eta = attn_eta_compute * L / (L + attn_len_half), L = context + new tokens
    attn_len_half: float = 0.0
    # a cache level in front of memory (calibrated CPU profiles): the first ``cache_bytes``
    # of one layer's decode-attention reads go at ``attn_eta_cache`` x BW; 0 turns it off
    cache_bytes: float = 0.0
    attn_eta_cache: float = 1.0
    # all-reduce: ((num devices, alpha seconds, algbw bytes/s), ...); others extrapolated
    allreduce: tuple[tuple[int, float, float], ...] = ()
    # a correction fitted on public measurements (benchmarks/fidelity.py): ((num devices,
    # alpha seconds), ...) in place of the fit's alpha at those counts; () keeps it as it is
    allreduce_alpha: tuple[tuple[int, float], ...] = ()
    # per iteration, on the host: in the runner (input preparation, sampling) ...
    iter_overhead: float = 1e-3
    seq_overhead: float = 10e-6
    # ... and around it (scheduler, engine, output processing); calibrated profiles split them
    host_overhead: float = 0.0
    host_seq_overhead: float = 0.0
    prefill_seg_overhead: float = 0.0  # per layer per prefill segment (one attention call each)
    decode_attn_padded: bool = False  # decode attention reads batch x longest context
    # query heads that share one read of their KV head in decode attention; 0: the whole
    # group (a grouped kernel, FlashInfer/XQA class). A kernel that splits a group of g over
    # thread blocks of k heads reads each KV head ceil(g / k) times (docs/fidelity.md)
    decode_heads_per_kv_read: int = 0
    launch_time: float = 4e-6  # host time to launch one kernel outside a captured graph
    kernels_per_layer: int = 14
    graph_max_batch: int = 256  # decode-only batches up to this size replay a captured graph
    mix_contention: float = 0.0  # extra decode-attention time in iterations that mix prefill
    source: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def ridge(self) -> float:
        """FLOP per byte where a GEMM turns compute bound."""
        return self.peak_flops / self.mem_bw

    @property
    def gemm_n_half(self) -> float:
        return self.gemm_ridge_frac * self.ridge

    def allreduce_params(self, n: int) -> tuple[float, float]:
        """(alpha, algbw) for ``n`` devices: measured where profiled, otherwise the nearest
        profiled size with the ring's bus bandwidth held constant (algbw ~ n / 2(n - 1))."""
        if n <= 1:
            return 0.0, math.inf
        measured = dict(self.allreduce_alpha)
        if not self.allreduce:
            return measured.get(n, 10e-6), self.link_bw * n / (2 * (n - 1))
        best = min(self.allreduce, key=lambda a: (abs(math.log(a[0] / n)), -a[0]))
        k, alpha, algbw = best
        alpha = measured.get(n, alpha)
        if k == n:
            return alpha, algbw
        bus = algbw * 2 * (k - 1) / k
        return alpha, bus * n / (2 * (n - 1))

    def replace(self, **changes: Any) -> Hardware:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["allreduce"] = [list(a) for a in self.allreduce]
        d["allreduce_alpha"] = [list(a) for a in self.allreduce_alpha]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Hardware:
        known = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["allreduce"] = tuple(tuple(a) for a in d.get("allreduce", ()))
        d["allreduce_alpha"] = tuple(tuple(a) for a in d.get("allreduce_alpha", ()))
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"hlserve_hardware_profile": 1, **self.to_dict()}, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Hardware:
        d = json.loads(Path(path).read_text())
        if "peak_flops" not in d:
            raise ValueError(f"{path} is not a hardware profile (no peak_flops)")
        return cls.from_dict(d)


# ---- fitted constants (python -m hlserve.sim.fitting) ------------------------------------------
# Vidur H100 (Llama-2-7B shapes, TP 1/2/4/8, 1-4096 tokens): median error 6.1% over 4176 rows
_HOPPER_GEMM = dict(gemm_eta_max=0.7728, gemm_ridge_frac=0.6117, gemm_eta_mem=1.0,
                    kernel_time=6.62e-6, elem_eta_mem=0.5209, elem_kernel_time=1.98e-6)
# Vidur A100 (Llama-3-8B shapes, TP 1/2/4/8, 1-32768 tokens): median error 4.7% over 7296 rows
_AMPERE_GEMM = dict(gemm_eta_max=0.7242, gemm_ridge_frac=0.4707, gemm_eta_mem=0.8122,
                    kernel_time=6.36e-6, elem_eta_mem=0.4456, elem_kernel_time=2.22e-6)
# Vidur NCCL all-reduce, single node: (GPUs, alpha s, algbw B/s); median errors 4-9%
_H100_AR = ((2, 26.1e-6, 324.1e9), (4, 31.3e-6, 253.1e9), (8, 30.2e-6, 196.7e9))
_A100_AR = ((2, 45.4e-6, 172.1e9), (4, 48.2e-6, 114.9e9), (8, 49.6e-6, 89.1e9))
_PCIE_SCALE = 64 / 600  # L40S PCIe Gen4 x16 vs A100 NVLink

_SRC_H = {"peak": "datasheet", "gemm": "Vidur H100 fit", "allreduce": "Vidur H100 NCCL fit",
          "attention, overheads": "assumed (see hardware.py)"}
_SRC_A = {"peak": "datasheet", "gemm": "Vidur A100 fit", "allreduce": "Vidur A100 NCCL fit",
          "attention, overheads": "assumed (see hardware.py)"}

HARDWARE: dict[str, Hardware] = {
    "H20": Hardware("H20", 148e12, 4.0e12, 96, 900e9, "hopper", allreduce=_H100_AR, **_HOPPER_GEMM,
                    source={**_SRC_H, "gemm": "Vidur H100 fit, n_half at the H20 ridge"}),
    "H100": Hardware("H100", 989e12, 3.35e12, 80, 900e9, "hopper", allreduce=_H100_AR, **_HOPPER_GEMM,
                     source=_SRC_H),
    "H200": Hardware("H200", 989e12, 4.8e12, 141, 900e9, "hopper", allreduce=_H100_AR, **_HOPPER_GEMM,
                     source={**_SRC_H, "gemm": "Vidur H100 fit, n_half at the H200 ridge"}),
    "A100": Hardware("A100", 312e12, 2.04e12, 80, 600e9, "ampere", allreduce=_A100_AR, **_AMPERE_GEMM,
                     source=_SRC_A),
    "L40S": Hardware("L40S", 362e12, 0.864e12, 48, 64e9, "ada", **_AMPERE_GEMM,
                     allreduce=tuple((n, a, b * _PCIE_SCALE) for n, a, b in _A100_AR),
                     source={**_SRC_A, "gemm": "Vidur A100 fit, n_half at the L40S ridge",
                             "allreduce": "Vidur A100 NCCL fit, bandwidth x 64/600 (PCIe)"}),
}
_ALIASES = {"A100-80GB": "A100", "A100-SXM": "A100", "H100-SXM": "H100", "H200-SXM": "H200"}


def parse_cluster(spec: str) -> tuple[str, int | None]:
    """``"8xH20"`` -> ("H20", 8); ``"H20"`` -> ("H20", None)."""
    head, sep, tail = spec.partition("x")
    if sep and head.isdigit():
        return tail, int(head)
    return spec, None


def get_hardware(name_or_path: str | Path | Hardware) -> Hardware:
    """A built-in profile by name (case-insensitive; ``8xH20`` style prefixes are dropped),
    or a profile JSON written by ``hlserve calibrate``."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    text = str(name_or_path)
    if text.endswith(".json") or Path(text).is_file():
        return Hardware.load(text)
    name, _ = parse_cluster(text)
    upper = {k.upper(): k for k in [*HARDWARE, *_ALIASES]}
    key = upper.get(name.upper())
    if key is None:
        raise ValueError(f"unknown hardware {text!r}: one of {', '.join(HARDWARE)} or a profile JSON")
    return HARDWARE[_ALIASES.get(key, key)]
