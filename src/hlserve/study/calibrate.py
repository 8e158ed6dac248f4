"""Calibrate the cost model on the machine at hand, and check it against real runs.

``calibrate`` measures the real runner (``TorchRunner``, on the CPU here, a GPU when present)
in three stages and writes a hardware profile the simulator loads like a built-in one:

1. peaks and GEMMs: a large matmul and a large copy give peak FLOP/s and bandwidth; the
   model's own linear-layer shapes, timed over a grid of token counts, fit the GEMM efficiency
   curve exactly as the Vidur GPU profiles are fitted (``fitting.fit_gemm``);
2. iterations: synthetic batches run through the runner (prefill sizes with and without
   cached context, decode batch x context, mixed batches); what the GEMMs do not explain is
   fitted, non-negative least squares on relative error, to the cost model's remaining
   terms: per-iteration and per-sequence overhead, per-segment attention overhead, prefill
   attention FLOP rate, decode attention byte rate, elementwise byte rate, mixing contention;
3. host: a short real engine run (calibration workload) gives the scheduler and engine time
   between two forwards, per iteration and per sequence, which a simulated iteration adds.

``fidelity`` then predicts a different workload (other lengths, concurrency and mode): it
runs it for real, recording every iteration, and in simulation on the profile, and reports
the per-iteration error and the end-to-end throughput error.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hlserve.config import EngineConfig
from hlserve.driver.workloads import AgentWorkload
from hlserve.engine.batch import Batch, Runner, ScheduledSeq, StepResult
from hlserve.models.model_config import ModelConfig
from hlserve.request import Request, SamplingParams
from hlserve.sim.cost import CostModel, IterationShape, shape_of
from hlserve.sim.fitting import OpSamples, fit_gemm, nnls_relative
from hlserve.sim.hardware import Hardware

# ---- timing ---------------------------------------------------------------------------------------
# On a CPU with one thread, time is the process's CPU time: other jobs on a shared machine then
# do not enter the measurements (for one thread on an idle machine CPU time is wall time). On a
# GPU, or with several threads, it is the wall clock.
_clock = time.perf_counter


def use_cpu_time(on: bool) -> None:
    global _clock
    _clock = time.process_time if on else time.perf_counter


def now() -> float:
    return _clock()


# ---- stage 1: peaks and GEMMs ------------------------------------------------------------------


def _time(fn, reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = now()
        fn()
        ts.append(now() - t)
    return statistics.median(ts)


def measure_peaks(dtype, device: str = "cpu") -> tuple[float, float]:
    """(FLOP/s of a large square matmul, bytes/s of a large copy: read + write)."""
    import torch

    gpu = device.startswith("cuda")
    n = 8192 if gpu else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    def mm() -> None:
        a @ b
        sync()

    flops = 2 * n**3 / _time(mm, 5)
    x = torch.empty((1024 if gpu else 64) * 2**20 // a.element_size(), dtype=dtype,
                    device=device).fill_(1)
    y = torch.empty_like(x)

    def cp() -> None:
        y.copy_(x)
        sync()

    bw = 2 * x.numel() * x.element_size() / _time(cp, 5)
    return flops, bw


def layer_gemms(mc: ModelConfig, tp: int = 1) -> list[tuple[str, int, int]]:
    """(name, K, N) of one layer's linear layers as the cost model sees them (fused)."""
    h, d = mc.hidden_size, mc.head_dim
    hq, hkv = mc.num_attention_heads // tp, -(-mc.num_key_value_heads // tp)
    inter = mc.intermediate_size // tp
    return [("qkv", h, (hq + 2 * hkv) * d), ("o", hq * d, h), ("gate_up", h, 2 * inter),
            ("down", inter, h)]


def gemm_samples(mc: ModelConfig, dtype, ns: list[int], device: str = "cpu") -> OpSamples:
    import torch
    import torch.nn.functional as F

    rows = []
    shapes = [*layer_gemms(mc), ("lm_head", mc.hidden_size, mc.vocab_size)]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for name, k, m in shapes:
        w = torch.randn(m, k, dtype=dtype, device=device)
        for n in ns:
            x = torch.randn(n, k, dtype=dtype, device=device)

            def run(x=x, w=w) -> None:
                F.linear(x, w)
                sync()

            reps = 7 if n * k * m < 5e7 else 3
            rows.append((name, n, 1, k, m, 0, _time(run, reps)))
    cols = list(zip(*rows, strict=True))
    return OpSamples(np.array(cols[0]), *(np.array(c, dtype=float) for c in cols[1:]))


# ---- stage 2: iterations on the real runner ------------------------------------------------------


class _Pages:
    """Page ids for synthetic batches: KV content does not matter for timing."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages, self.page_size, self.next = num_pages, page_size, 0

    def take(self, tokens: int) -> list[int]:
        k = -(-tokens // self.page_size)
        if self.next + k > self.num_pages:
            self.next = 0
        out = list(range(self.next, self.next + k))
        self.next += k
        return out


def synthetic_batch(pages: _Pages, prefills: list[tuple[int, int]], decodes: list[int],
                    vocab: int) -> Batch:
    """``prefills``: (cached context, new tokens); ``decodes``: context lengths."""
    seqs = []
    for ctx, q in prefills:
        req = Request(prompt_token_ids=[(7 * i + 3) % vocab for i in range(ctx + q)],
                      params=SamplingParams(max_tokens=4))
        seqs.append(ScheduledSeq(req, ctx, q, pages.take(ctx + q)))
    for length in decodes:
        req = Request(prompt_token_ids=[(5 * i + 3) % vocab for i in range(length)],
                      params=SamplingParams(max_tokens=4))
        seqs.append(ScheduledSeq(req, length - 1, 1, pages.take(length)))
    return Batch(seqs)


def default_grid(max_len: int = 4096, quick: bool = False) -> list[tuple[list[tuple[int, int]], list[int]]]:
    """(prefills, decodes) of the calibration batches: log-spaced sizes, so that no regime
    (cache-resident or not, overhead- or work-bound) dominates the fit."""
    grid: list[tuple[list[tuple[int, int]], list[int]]] = []
    for n in (16, 64, 256, 1024, 2048) if quick else (8, 32, 128, 256, 512, 1024, 2048):
        grid.append(([(0, n)], []))
    for ctx, q in ((1024, 128), (2048, 512)) if quick else ((512, 64), (1024, 256), (2048, 512), (3072, 128)):
        grid.append(([(ctx, q)], []))
    grid.append(([(0, 256)] * 4, []))  # several segments
    for b in (1, 4, 16) if quick else (1, 2, 4, 8, 16, 32):
        for length in (128, 1024, 3072) if quick else (64, 256, 1024, 2048, 4096):
            grid.append(([], [min(length, max_len)] * b))
    grid.append(([], [256, 3072, 1024, 512] * 4))  # ragged contexts
    for b, length, q in ((8, 1024, 256), (16, 2048, 512)) if quick else ((4, 512, 128), (8, 1024, 256), (16, 2048, 512), (32, 512, 64)):
        grid.append(([(0, q)], [length] * b))
    return grid


def measure_iterations(runner: Runner, grid, vocab: int, reps: int = 3) -> list[tuple[IterationShape, float]]:
    pages = _Pages(runner.num_pages, runner.page_size)
    out = []
    for prefills, decodes in grid:
        batch = synthetic_batch(pages, prefills, decodes, vocab)
        runner.execute(batch)  # warm-up
        ts = []
        for _ in range(reps):
            t = now()
            runner.execute(batch)
            ts.append(now() - t)
        ts.sort()
        out.append((shape_of(batch), ts[len(ts) // 2]))
    return out


_ZERO = dict(attn_eta_compute=1e12, attn_eta_mem=1e12, elem_eta_mem=1e12, elem_kernel_time=0.0,
             iter_overhead=0.0, seq_overhead=0.0, prefill_seg_overhead=0.0, mix_contention=0.0,
             host_overhead=0.0, host_seq_overhead=0.0)


def _features(cm: CostModel, s: IterationShape, cache: float) -> list[float]:
    L = cm.layers
    pairs = sum(q * (ctx + (q + 1) / 2) for q, ctx in s.prefill)
    keys = s.num_decodes * s.decode_ctx_max if cm.hw.decode_attn_padded else s.decode_ctx_sum
    dec = cm.kv_decode_read_per_token * keys + cm.q_bytes_per_token * s.num_decodes  # one layer
    hit = min(dec, cache)
    mixed = 1.0 if (s.prefill and s.num_decodes) else 0.0
    return [1.0, float(s.num_seqs), float(L * len(s.prefill)), L * cm.attn_flops_per_pair * pairs,
            L * hit, L * (dec - hit), L * dec * mixed, L * s.num_tokens * cm.elem_bytes]


CACHE_CANDIDATES = (0.0, 0.5 * 2**20, 1 * 2**20, 2 * 2**20, 4 * 2**20, 8 * 2**20, 16 * 2**20,
                    32 * 2**20)


def fit_iterations(base: Hardware, mc: ModelConfig, data: list[tuple[IterationShape, float]],
                   caches: tuple[float, ...] = CACHE_CANDIDATES) -> tuple[Hardware, dict[str, float]]:
    """Fit the non-GEMM terms of ``base`` to measured iterations, non-negative least squares
    on relative error, for each candidate cache size; keep the best. Returns the profile and
    its errors on the calibration set."""
    hw0 = base.replace(**_ZERO)
    cm0 = CostModel(mc, hw0)
    y = np.array([t for _, t in data])
    gemm_part = np.array([cm0.iteration(s)[0] for s, _ in data])
    big = 1e12
    best: tuple[float, Hardware] | None = None
    for cache in caches:
        feats = np.array([_features(cm0, s, cache) for s, _ in data])  # cache 0: no hits
        coef = nnls_relative(feats, y - gemm_part, 1 / y)
        c_iter, c_seq, c_seg, c_ap, c_hit, c_mem, c_mix, c_el = (float(c) for c in coef)
        if c_mem <= 0:
            c_mem = c_hit
        if cache > 0 and c_hit <= 0:
            continue
        dec_rate = c_mem  # seconds per byte beyond the cache, the rate contention scales
        hw = base.replace(
            iter_overhead=c_iter, seq_overhead=c_seq, prefill_seg_overhead=c_seg,
            attn_eta_compute=1 / (c_ap * base.peak_flops) if c_ap > 0 else big,
            attn_eta_mem=1 / (c_mem * base.mem_bw) if c_mem > 0 else big,
            cache_bytes=cache,
            attn_eta_cache=1 / (c_hit * base.mem_bw) if c_hit > 0 else 1.0,
            mix_contention=c_mix / dec_rate if dec_rate > 0 else 0.0,
            elem_eta_mem=1 / (c_el * base.mem_bw) if c_el > 0 else big, elem_kernel_time=0.0,
        )
        cm = CostModel(mc, hw)
        err = float(np.mean(np.abs(np.array([cm.iteration(s)[0] for s, _ in data]) / y - 1)))
        if best is None or err < best[0]:
            best = (err, hw)
    assert best is not None
    hw = best[1]
    cm = CostModel(mc, hw)
    pred = np.array([cm.iteration(s)[0] for s, _ in data])
    err = np.abs(pred / y - 1)
    return hw, {"median_err": float(np.median(err)), "max_err": float(err.max()),
                "mean_err": float(err.mean()), "points": len(data),
                "cache_bytes": hw.cache_bytes}


# ---- stage 3 and real runs: a recording runner ------------------------------------------------------


@dataclass
class StepRecord:
    shape: IterationShape
    elapsed: float  # the runner's own measurement of the forward
    start: float  # wall time the step's execute began
    period: float = 0.0  # wall time to the next execute: forward + scheduler + engine


class RecordingRunner(Runner):
    """Wraps a runner; records every step's shape, forward time and step period."""

    def __init__(self, inner: Runner) -> None:
        self.inner = inner
        self.model_config = inner.model_config
        self.num_pages = inner.num_pages
        self.page_size = inner.page_size
        self.steps: list[StepRecord] = []

    def execute(self, batch: Batch) -> StepResult:
        t = now()
        if self.steps:
            self.steps[-1].period = t - self.steps[-1].start
        shape = shape_of(batch)
        res = self.inner.execute(batch)
        self.steps.append(StepRecord(shape, now() - t, t))
        return res

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def finish(self) -> list[StepRecord]:
        """Steps with a known period (the last one has none)."""
        return [s for s in self.steps if s.period > 0]


def real_engine(model_dir: str, engine_options: dict[str, Any], recording: bool = True):
    """An Engine on the real runner (on this module's clock), with the runner wrapped for
    recording; returns (engine, runner)."""
    from hlserve.engine.args import make_config
    from hlserve.engine.factory import build_engine
    from hlserve.models.resolve import resolve_model
    from hlserve.runner.torch_runner import TorchRunner
    from hlserve.tokenizer import Tokenizer

    config = make_config(resolve_model(model_dir), **engine_options)
    inner = TorchRunner(config)
    runner = RecordingRunner(inner) if recording else inner
    engine = build_engine(config, runner, tokenizer=Tokenizer.from_dir, clock=_clock)
    return engine, runner


def fit_host(steps: list[StepRecord]) -> tuple[float, float]:
    """(per-iteration, per-sequence) host time between forwards."""
    y = np.array([s.period - s.elapsed for s in steps])
    x = np.array([[1.0, s.shape.num_seqs] for s in steps])
    keep = y > 0
    if keep.sum() < 3:
        return 0.0, 0.0
    y, x = y[keep], x[keep]
    # a robust fit: medians of the two halves by batch size (a few steps are preempted by the OS)
    med = np.median(y)
    keep = y < 5 * med
    coef = nnls_relative(x[keep], y[keep], np.ones(int(keep.sum())))
    return float(coef[0]), float(coef[1])


# ---- the whole calibration ---------------------------------------------------------------------------

CALIBRATION_WORKLOAD = dict(sessions=4, rounds=2, system_prompt_len=384, task_len=48,
                            tool_output_len=(96, 320), output_len=(24, 40), seed=11)
CALIBRATION_OPTIONS: dict[str, Any] = {"preset": "vllm"}


@dataclass
class Calibration:
    hardware: Hardware
    report: dict[str, Any] = field(default_factory=dict)


def _with_threads(threads: int | None, device: str):
    """Run with ``threads`` CPU threads and put the old setting back afterwards."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def ctx():
        old = torch.get_num_threads()
        if threads is not None and device == "cpu":
            torch.set_num_threads(threads)
        use_cpu_time(device == "cpu" and torch.get_num_threads() == 1)
        try:
            yield
        finally:
            torch.set_num_threads(old)
            use_cpu_time(False)

    return ctx()


def calibrate(model_dir: str, name: str = "cpu", threads: int | None = 1, quick: bool = False,
              device: str = "cpu", progress: bool = False) -> Calibration:
    """Measure the machine at hand (see the module docstring); ``threads`` CPU threads."""
    with _with_threads(threads, device):
        return _calibrate(model_dir, name, quick, device, progress)


def _calibrate(model_dir: str, name: str, quick: bool, device: str, progress: bool) -> Calibration:
    import torch

    from hlserve.models.loader import resolve_dtype
    from hlserve.runner.torch_runner import TorchRunner

    t_start = time.perf_counter()
    mc = ModelConfig.from_dir(model_dir)
    dtype = resolve_dtype("auto", mc, torch.device(device))
    dbytes = torch.tensor([], dtype=dtype).element_size()

    def say(msg: str) -> None:
        if progress:
            print(f"[calibrate {time.perf_counter() - t_start:5.1f}s] {msg}", flush=True)

    peak, bw = measure_peaks(dtype, device)
    say(f"peak {peak / 1e9:.1f} GFLOP/s, copy {bw / 1e9:.1f} GB/s ({dtype})")
    ns = [1, 4, 16, 64, 256, 1024] if quick else [1, 2, 8, 32, 64, 128, 256, 512, 1024, 2048]
    gs = gemm_samples(mc, dtype, ns, device)
    g = fit_gemm(gs, peak, bw, dbytes, max_eta=1.0 if device.startswith("cuda") else 8.0)
    say(f"GEMM fit: eta_max {g.eta_max:.3f}, n_half {g.n_half:.1f}, eta_mem {g.eta_mem:.3f}, "
        f"t_kernel {g.t_kernel * 1e6:.1f}us; median error {g.median_err:.1%}")
    base = Hardware(
        name=name, peak_flops=peak, mem_bw=bw, mem_gib=0.0, link_bw=0.0, arch=device.split(":")[0],
        dtype_bytes=dbytes, gemm_eta_max=g.eta_max, gemm_ridge_frac=g.ridge_frac,
        gemm_eta_mem=g.eta_mem, kernel_time=g.t_kernel, decode_attn_padded=False, launch_time=0.0,
        kernels_per_layer=0, graph_max_batch=0, allreduce=(),
        source={"peak": "measured: square matmul (8192 on GPU, 1024 on CPU), copy (1 GiB / 64 MiB)",
                "gemm": f"fitted to this model's GEMM shapes ({len(gs.time)} timings)",
                "attention, overheads": "fitted to iterations of the real runner",
                "host": "fitted to a real engine run (scheduler and engine time)",
                "threads": str(torch.get_num_threads()), "model": str(model_dir),
                "timer": "process CPU time" if _clock is time.process_time else "wall clock"},
    )
    runner = TorchRunner(EngineConfig(model=str(model_dir), device=device, num_pages=4096, page_size=16))
    grid = default_grid(quick=quick)
    data = measure_iterations(runner, grid, mc.vocab_size, reps=3 if quick else 5)
    hw, fit_err = fit_iterations(base, mc, data)
    say(f"iteration fit over {len(data)} batches: median error {fit_err['median_err']:.1%}, "
        f"max {fit_err['max_err']:.1%}")
    del runner
    # stage 3: host time around the forward, from a real engine run
    engine, rec = real_engine(str(model_dir), {**CALIBRATION_OPTIONS, "device": device})
    from hlserve.driver.closed_loop import run_agent_sessions

    run_agent_sessions(engine, AgentWorkload(**CALIBRATION_WORKLOAD), progress=False)
    steps = rec.finish()
    h_iter, h_seq = fit_host(steps)
    hw = hw.replace(host_overhead=h_iter, host_seq_overhead=h_seq)
    say(f"host: {h_iter * 1e6:.0f}us per iteration + {h_seq * 1e6:.1f}us per sequence "
        f"({len(steps)} steps)")
    report = {
        "peak_flops": peak, "mem_bw": bw, "threads": torch.get_num_threads(),
        "gemm_fit": {"median_err": g.median_err, "p90_err": g.p90_err, "points": g.count},
        "iteration_fit": fit_err, "host": {"per_iteration_s": h_iter, "per_seq_s": h_seq,
                                           "steps": len(steps)},
        "seconds": time.perf_counter() - t_start,
    }
    return Calibration(hw, report)


# ---- fidelity --------------------------------------------------------------------------------------

FIDELITY_WORKLOAD = dict(sessions=6, rounds=3, system_prompt_len=640, task_len=96,
                         tool_output_len=(160, 480), output_len=(40, 72), seed=23)
FIDELITY_OPTIONS: dict[str, Any] = {"mode": "throughput"}


PROBES: list[tuple[list[tuple[int, int]], list[int]]] = [
    ([(0, 256)], []), ([], [1024] * 4), ([], [256] * 16), ([(0, 256)], [1024] * 8),
]


def _rel(a: float, b: float) -> float:
    return a / b - 1 if b else float("nan")


def machine_drift(model_dir: str, hw: Hardware, device: str, reps: int = 5) -> float:
    """How much slower the machine runs now than when ``hw`` was calibrated: the median of
    measured / predicted over a few probe batches (1.0: as calibrated). A shared machine's
    speed drifts with its other jobs; this separates that from the model's error."""
    from hlserve.runner.torch_runner import TorchRunner

    mc = ModelConfig.from_dir(model_dir)
    runner = TorchRunner(EngineConfig(model=str(model_dir), device=device, num_pages=1024))
    cm = CostModel(mc, hw)
    data = measure_iterations(runner, PROBES, mc.vocab_size, reps=reps)
    host = [hw.host_overhead + hw.host_seq_overhead * sh.num_seqs for sh, _ in data]
    return float(np.median([t / (cm.iteration(sh)[0] - h) for (sh, t), h in zip(data, host, strict=True)]))


def fidelity(model_dir: str, hw: Hardware, workload: AgentWorkload | None = None,
             engine_options: dict[str, Any] | None = None, device: str = "cpu",
             threads: int | None = 1) -> dict[str, Any]:
    """Run ``workload`` for real and in simulation on ``hw``; compare per iteration and end
    to end."""
    with _with_threads(threads, device):
        return _fidelity(model_dir, hw, workload, engine_options, device)


def _fidelity(model_dir: str, hw: Hardware, workload: AgentWorkload | None,
              engine_options: dict[str, Any] | None, device: str) -> dict[str, Any]:
    from hlserve.driver.closed_loop import run_agent_sessions
    from hlserve.engine.factory import build_engine
    from hlserve.engine.llm_engine import VirtualClock
    from hlserve.sim.sim_runner import SimRunner

    workload = workload or AgentWorkload(**FIDELITY_WORKLOAD)
    opts = {**(engine_options or FIDELITY_OPTIONS), "device": device}
    drift_before = machine_drift(model_dir, hw, device)
    engine, rec = real_engine(str(model_dir), opts)
    t = now()
    real = run_agent_sessions(engine, workload, progress=False)
    wall = now() - t
    drift = (drift_before * machine_drift(model_dir, hw, device)) ** 0.5
    steps = rec.finish()
    cm = CostModel(engine.model_config, hw)
    pred_step = np.array([cm.iteration(s.shape)[0] for s in steps])
    # the forward alone: the predicted step less the host time the profile adds to it
    pred_fwd = pred_step - np.array([hw.host_overhead + hw.host_seq_overhead * s.shape.num_seqs
                                     for s in steps])
    fwd = np.array([s.elapsed for s in steps])
    period = np.array([s.period for s in steps])
    # the same workload in simulation: the same options and pool, the one engine factory, the
    # virtual clock
    sim_engine = build_engine(engine.config.replace(num_pages=engine.kv_num_pages),
                              lambda c: SimRunner(c, hw, 1, model=str(model_dir)),
                              clock=VirtualClock())
    sim = run_agent_sessions(sim_engine, workload, progress=False)
    rs, ss = real.summary(), sim.summary()
    per_step_err = np.abs(pred_step / period - 1)
    corr_err = np.abs(drift * pred_step / period - 1)
    return {
        "workload": {k: getattr(workload, k) for k in ("sessions", "rounds", "system_prompt_len",
                                                         "task_len", "tool_output_len", "output_len")},
        "engine_options": engine_options or FIDELITY_OPTIONS,
        "real_wall_s": wall,
        "timer": "process CPU time" if _clock is time.process_time else "wall clock",
        "iterations": {"real": len(steps) + 1, "sim": sim_engine.stats.steps},
        "per_iteration": {
            "median_abs_err": float(np.median(per_step_err)),
            "p90_abs_err": float(np.percentile(per_step_err, 90)),
            "sum_err": _rel(float(pred_step.sum()), float(period.sum())),
            "forward_median_abs_err": float(np.median(np.abs(pred_fwd / fwd - 1))),
            "forward_sum_err": _rel(float(pred_fwd.sum()), float(fwd.sum())),
        },
        "machine_drift": drift,
        "drift_corrected": {
            "per_iteration_median_abs_err": float(np.median(corr_err)),
            "per_iteration_sum_err": _rel(drift * float(pred_step.sum()), float(period.sum())),
            "throughput_err": _rel(ss["total_token_throughput"] / drift, rs["total_token_throughput"]),
        },
        "end_to_end": {
            "real_total_token_throughput": rs["total_token_throughput"],
            "sim_total_token_throughput": ss["total_token_throughput"],
            "throughput_err": _rel(ss["total_token_throughput"], rs["total_token_throughput"]),
            "real_duration_s": rs["duration"], "sim_duration_s": ss["duration"],
            "real_median_ttft_ms": rs["median_ttft_ms"], "sim_median_ttft_ms": ss["median_ttft_ms"],
            "real_median_tpot_ms": rs["median_tpot_ms"], "sim_median_tpot_ms": ss["median_tpot_ms"],
            "tpot_err": _rel(ss["median_tpot_ms"], rs["median_tpot_ms"]),
        },
    }


def write_profile(cal: Calibration, path: str | Path) -> None:
    cal.hardware.save(path)
    Path(str(path) + ".report.json").write_text(json.dumps(cal.report, indent=2, default=str))
