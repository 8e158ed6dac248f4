"""Fits of the cost model's efficiency terms to public measurements (Vidur's GEMM and
all-reduce profiles, ``data/vidur/``), and the least-squares helpers calibration shares.

GEMM: ``t = max(F / (eta_c(n) * peak), bytes / (eta_m * BW)) + t_kernel`` with
``eta_c(n) = eta_max * n / (n + n_half)`` and ``n_half = a * ridge`` (ridge = peak / BW, in
FLOP per byte). Tying ``n_half`` to the ridge point is the one modelling assumption that
carries a fit to a GPU without a profile (H20, H200, L40S): the compute efficiency saturates
where the GEMM stops being bandwidth bound. Fitted separately, A100 and H100 give a = 0.47
and 0.61, n_half 72 and 180 tokens; ``python -m hlserve.sim.fitting`` prints the fits.

All-reduce: ``t = alpha + size / algbw`` per number of GPUs, fitted on log time.

Run ``python -m hlserve.sim.fitting`` to refit and print the constants stored in
``hardware.py`` (they are stored so that the simulator runs without the data files).
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GPU specs the Vidur profiles were taken on (the vendors' datasheets)
VIDUR_GPUS = {
    "a100": ("compute__a100__meta-llama__Meta-Llama-3-8B__mlp.csv", "network__a100_dgx__all_reduce.csv",
             312e12, 2.04e12),
    "h100": ("compute__h100__meta-llama__Llama-2-7b-hf__mlp.csv", "network__h100_dgx__all_reduce.csv",
             989e12, 3.35e12),
}
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEM_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")


# the public data shipped inside the package (its README names each file's source and licence)
PACKAGE_DATA = Path(__file__).resolve().parents[1] / "data"


def find_data_dir() -> Path:
    """``$HLSERVE_DATA_DIR`` where set (a folder of the same layout), else the package's own
    ``data/``."""
    env = os.environ.get("HLSERVE_DATA_DIR")
    return Path(env) if env else PACKAGE_DATA


def _data_dir(data_dir: Path | None) -> Path:
    d = data_dir or find_data_dir()
    if not (d / "vidur").is_dir():
        raise FileNotFoundError("Vidur profiles not found: set HLSERVE_DATA_DIR to the data folder")
    return d


@dataclass
class OpSamples:
    """Measured operator times with their shapes: one row per (op, tokens, TP degree)."""

    op: np.ndarray  # op names
    n: np.ndarray  # tokens
    tp: np.ndarray
    k: np.ndarray  # GEMM inner dim (0 for elementwise)
    m: np.ndarray  # GEMM output dim (0 for elementwise)
    nbytes: np.ndarray  # bytes moved (elementwise) or minimal bytes (GEMM), 2-byte dtype
    time: np.ndarray  # seconds (median of the profile's repeats)


def load_vidur_ops(gpu: str, data_dir: Path | None = None) -> tuple[OpSamples, OpSamples]:
    """(GEMM samples, elementwise samples) of one GPU's Vidur MLP/attention-projection profile."""
    fname = VIDUR_GPUS[gpu][0]
    with open(_data_dir(data_dir) / "vidur" / fname) as f:
        rows = list(csv.DictReader(f))
    g: list[tuple] = []
    e: list[tuple] = []
    for r in rows:
        n, t = int(r["num_tokens"]), int(r["num_tensor_parallel_workers"])
        h, inter = int(r["n_embd"]), int(r["n_expanded_embd"])
        heads, kvh = int(r["n_head"]), int(r["n_kv_head"])
        d = h // heads
        shapes = {
            "attn_pre_proj": (h, (heads + 2 * kvh) * d // t),
            "attn_post_proj": (heads * d // t, h),
            "mlp_up_proj": (h, 2 * inter // t),
            "mlp_down_proj": (inter // t, h),
        }
        for op, (k, m) in shapes.items():
            sec = float(r[f"time_stats.{op}.median"]) * 1e-3
            g.append((op, n, t, k, m, 2 * (k * m + n * k + n * m), sec))
        elem_bytes = {
            "input_layernorm": 4 * n * h,
            "post_attention_layernorm": 4 * n * h,
            "attn_rope": 4 * n * (heads + kvh) // t * d,
            "mlp_act": 6 * n * inter // t,
            "add": 6 * n * h,
        }
        for op, nb in elem_bytes.items():
            sec = float(r[f"time_stats.{op}.median"]) * 1e-3
            e.append((op, n, t, 0, 0, nb, sec))

    def pack(items: list[tuple]) -> OpSamples:
        cols = list(zip(*items, strict=True))
        return OpSamples(np.array(cols[0]), *(np.array(c, dtype=float) for c in cols[1:]))

    return pack(g), pack(e)


def gemm_time_np(n: np.ndarray, k: np.ndarray, m: np.ndarray, peak: float, bw: float,
                 eta_max: float, n_half: float, eta_mem: float, t_kernel: float,
                 dtype_bytes: int = 2) -> np.ndarray:
    """The cost model's GEMM time, vectorised (cost.py has the scalar twin)."""
    flops = 2.0 * n * k * m
    nbytes = dtype_bytes * (k * m + n * k + n * m)
    eta_c = eta_max * n / (n + n_half)
    return np.maximum(flops / (eta_c * peak), nbytes / (eta_mem * bw)) + t_kernel


@dataclass
class GemmFit:
    eta_max: float
    ridge_frac: float  # n_half = ridge_frac * peak / BW
    n_half: float
    eta_mem: float
    t_kernel: float
    median_err: float
    p90_err: float
    count: int


def fit_gemm(samples: OpSamples, peak: float, bw: float, dtype_bytes: int = 2,
             max_eta: float = 1.0) -> GemmFit:
    """Least squares on log time (robust loss: a few profile rows are outliers). ``max_eta``
    bounds the efficiencies: 1 for datasheet peaks; more where the reference peak is itself a
    measurement that caches can beat (a CPU's weights may sit in cache)."""
    from scipy.optimize import least_squares

    ridge = peak / bw
    logy = np.log(samples.time)

    def predict(p: np.ndarray) -> np.ndarray:
        return gemm_time_np(samples.n, samples.k, samples.m, peak, bw, p[0], p[1] * ridge,
                            p[2], p[3] * 1e-6, dtype_bytes)

    res = least_squares(lambda p: np.log(predict(p)) - logy, x0=[0.75, 0.5, 0.85, 5.0],
                        bounds=([0.05, 1e-3, 0.05, 0.0], [max_eta, 100.0, max_eta, 200.0]),
                        loss="soft_l1", f_scale=0.05)
    err = np.abs(predict(res.x) / samples.time - 1)
    return GemmFit(float(res.x[0]), float(res.x[1]), float(res.x[1] * ridge), float(res.x[2]),
                   float(res.x[3] * 1e-6), float(np.median(err)), float(np.percentile(err, 90)),
                   len(err))


@dataclass
class ElemFit:
    eta_mem: float
    t_kernel: float
    median_err: float


def fit_elementwise(samples: OpSamples, bw: float) -> ElemFit:
    """Elementwise ops (norms, rope, activation, residual add): bytes / (eta * BW) + t_kernel."""
    from scipy.optimize import least_squares

    logy = np.log(samples.time)

    def predict(p: np.ndarray) -> np.ndarray:
        return samples.nbytes / (p[0] * bw) + p[1] * 1e-6

    res = least_squares(lambda p: np.log(predict(p)) - logy, x0=[0.5, 3.0],
                        bounds=([0.01, 0.0], [1.0, 100.0]), loss="soft_l1", f_scale=0.05)
    err = np.abs(predict(res.x) / samples.time - 1)
    return ElemFit(float(res.x[0]), float(res.x[1] * 1e-6), float(np.median(err)))


@dataclass
class AllReduceFit:
    num_gpus: int
    alpha: float  # seconds
    algbw: float  # bytes / second (size / time in the bandwidth regime)
    median_err: float
    count: int


def load_vidur_allreduce(gpu: str, data_dir: Path | None = None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """num GPUs -> (sizes in bytes, median seconds), single-node rows only."""
    fname = VIDUR_GPUS[gpu][1]
    out: dict[int, tuple[list[float], list[float]]] = {}
    with open(_data_dir(data_dir) / "vidur" / fname) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        nw, per_node = int(r["num_workers"]), int(r["devices_per_node"])
        if nw != per_node or r["collective"] != "all_reduce":
            continue
        sizes, times = out.setdefault(nw, ([], []))
        sizes.append(float(r["size"]))  # bytes (Vidur's profiler records elements * 2)
        times.append(float(r["time_stats.all_reduce.median"]) * 1e-3)
    return {k: (np.array(s), np.array(t)) for k, (s, t) in sorted(out.items())}


def fit_allreduce(sizes: np.ndarray, times: np.ndarray, num_gpus: int) -> AllReduceFit:
    from scipy.optimize import least_squares

    logy = np.log(times)
    res = least_squares(lambda p: np.log(p[0] * 1e-6 + sizes / (p[1] * 1e9)) - logy,
                        x0=[20.0, 100.0], bounds=([0.0, 1.0], [1e4, 1e4]),
                        loss="soft_l1", f_scale=0.1)
    err = np.abs((res.x[0] * 1e-6 + sizes / (res.x[1] * 1e9)) / times - 1)
    return AllReduceFit(num_gpus, float(res.x[0] * 1e-6), float(res.x[1] * 1e9),
                        float(np.median(err)), len(err))


def fit_vidur(data_dir: Path | None = None) -> dict[str, dict]:
    """Every fit, per profiled GPU."""
    out: dict[str, dict] = {}
    for gpu, (_, _, peak, bw) in VIDUR_GPUS.items():
        gemm, elem = load_vidur_ops(gpu, data_dir)
        ar = load_vidur_allreduce(gpu, data_dir)
        out[gpu] = {
            "gemm": fit_gemm(gemm, peak, bw),
            "elementwise": fit_elementwise(elem, bw),
            "allreduce": {n: fit_allreduce(s, t, n) for n, (s, t) in ar.items()},
        }
    return out


def nnls_relative(features: np.ndarray, target: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Non-negative least squares of ``features @ x ~ target`` with per-row weights (1/y for
    relative error)."""
    from scipy.optimize import nnls

    w = weights[:, None]
    scale = np.maximum(np.abs(features * w).max(axis=0), 1e-30)  # column scaling for conditioning
    x, _ = nnls(features * w / scale, target * weights)
    return x / scale


def main() -> None:
    fits = fit_vidur()
    for gpu, f in fits.items():
        g: GemmFit = f["gemm"]
        e: ElemFit = f["elementwise"]
        print(f"{gpu}: GEMM eta_max={g.eta_max:.4f} n_half={g.n_half:.1f} (= {g.ridge_frac:.4f} x ridge) "
              f"eta_mem={g.eta_mem:.4f} t_kernel={g.t_kernel * 1e6:.2f}us  median err "
              f"{g.median_err:.1%} p90 {g.p90_err:.1%} over {g.count} rows")
        print(f"{gpu}: elementwise eta_mem={e.eta_mem:.4f} t_kernel={e.t_kernel * 1e6:.2f}us "
              f"median err {e.median_err:.1%}")
        for n, a in f["allreduce"].items():
            print(f"{gpu}: all-reduce x{n}: alpha={a.alpha * 1e6:.1f}us algbw={a.algbw / 1e9:.1f}GB/s "
                  f"median err {a.median_err:.1%} over {a.count} sizes")


if __name__ == "__main__":
    main()
