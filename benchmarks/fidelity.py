"""The simulator against public GPU measurements: every row of ``fidelity_rows.json`` with its
source, the simulated value and the error, and the median and worst |error| per group.

Groups: attention (kernel TFLOP/s by sequence length), single-request (time to first token),
large-batch decode (static-batch output throughput), serving (in-flight batching at a fixed
concurrency, replayed through the simulated engine), serving at once (every request of a run
sent together, each with its recorded prompt and output length, replayed the same way),
mixed-batch (a prefill chunk with decodes riding along) and GEMM held-out rows (Vidur's
operator profiles, refitted on part of the rows and scored on the rest, and the A100 fit
carried to H100 the way H20 borrows H100's fit).

    python benchmarks/fidelity.py                # the tables of docs/fidelity.md (~4 minutes)
    python benchmarks/fidelity.py --json out.json
    python benchmarks/fidelity.py --no-serving   # without the engine replays (seconds)

Rows marked ``fit`` may be used to fit a term; ``heldout`` rows never are; ``other-kernel``
rows show how far another kernel on the same shapes lies and are not scored.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hlserve.driver.closed_loop import Loop, LoopResult, run_closed_loop
from hlserve.driver.workloads import BLOCK, MooncakeTrace, TraceRequest
from hlserve.models.model_config import ModelConfig
from hlserve.sim.build import SimOptions, build_sim_engine
from hlserve.sim.cost import CostModel, IterationShape
from hlserve.sim.hardware import Hardware, get_hardware
from hlserve.sim.model_specs import _shape

ROWS = Path(__file__).with_name("fidelity_rows.json")


@dataclass
class Result:
    id: str
    group: str
    split: str
    measured: float
    simulated: float
    unit: str
    source: str

    @property
    def error(self) -> float:
        """Signed relative error of the simulated value."""
        return self.simulated / self.measured - 1.0


def load(path: Path = ROWS) -> dict:
    return json.loads(path.read_text())


def model_of(data: dict, name: str) -> ModelConfig:
    m = data["models"][name]
    return _shape(m["arch"], m["layers"], m["hidden"], m["heads"], m["kv_heads"], m["inter"],
                  m["vocab"], 4096)


# ---- one simulated value per kind ----------------------------------------------------------
def attn_prefill_tflops(hw: Hardware, row: dict) -> float:
    """Achieved TFLOP/s of one non-causal attention call, the cost model's prefill-attention
    term (the same max(compute, memory) + kernel time as ``CostModel.iteration``)."""
    b, h, s, d = row["batch"], row["heads"], row["seqlen"], row["head_dim"]
    flops = 4.0 * b * h * s * s * d
    nbytes = hw.dtype_bytes * 4 * b * h * s * d  # Q, K, V read, O written
    eta = hw.attn_eta_compute * (s / (s + hw.attn_len_half) if hw.attn_len_half > 0 else 1.0)
    t = max(flops / (eta * hw.peak_flops), nbytes / (hw.attn_eta_mem * hw.mem_bw))
    return flops / (t + hw.kernel_time) / 1e12


def first_token_ms(cm: CostModel, row: dict) -> float:
    return 1e3 * cm.prefill(row["input"]).total


def static_batch_out_tps(cm: CostModel, row: dict) -> float:
    """A static batch: every prompt prefilled in one iteration, then ``output - 1`` decode
    iterations of the whole batch (TensorRT-LLM's gptSessionBenchmark)."""
    b, isl, osl = row["batch"], row["input"], row["output"]
    pf = IterationShape(num_tokens=b * isl, num_seqs=b, num_samples=b,
                        prefill=tuple((isl, 0) for _ in range(b)))
    t = cm.iteration(pf)[0]
    for i in range(1, osl):
        ctx = isl + i
        t += cm.iteration(IterationShape(b, b, b, (), b, b * ctx, ctx))[0]
    return b * osl / t


def mixed_over_prefill(cm: CostModel, row: dict) -> float:
    """Time of a prefill chunk with decodes riding along over the same number of prefill
    tokens alone."""
    n, k, ctx = row["prefill"], row["decodes"], row["decode_context"]
    mixed = cm.decode(k, ctx, prefill_tokens=n).total
    alone = cm.iteration(IterationShape(n + k, 1, 0, ((n + k, 0),)))[0]
    return mixed / alone


def attn_layer_ms(cm: CostModel, row: dict) -> float:
    """One layer's attention kernel: a prefill chunk over a cached context, or a decode batch
    (``hlserve cost``'s attention terms divided by the layers, plus one kernel's time)."""
    ctx = row["context"]
    if "prefill" in row:
        q = row["prefill"]
        shape = IterationShape(q, 1, 0, ((q, ctx),))
        part = "attention prefill"
    else:
        b = row["decodes"]
        shape = IterationShape(b, b, 0, (), b, b * ctx, ctx)
        part = "attention decode"
    bd = cm.iteration(shape, detail=True)[1]
    assert bd is not None
    return 1e3 * (bd.parts.get(part, 0.0) / cm.layers + cm.hw.kernel_time)


def _hf_config(m: dict, max_len: int) -> dict:
    """A Hugging Face ``config.json`` of a row's model (what the simulated engine loads)."""
    return {"architectures": [m["arch"]], "hidden_size": m["hidden"], "intermediate_size": m["inter"],
            "num_hidden_layers": m["layers"], "num_attention_heads": m["heads"],
            "num_key_value_heads": m["kv_heads"], "vocab_size": m["vocab"],
            "max_position_embeddings": max_len, "torch_dtype": "float16"}


@dataclass
class _Client:
    """One client of a fixed-length serving run, as a closed-loop session: ``rounds``
    requests one after another (the next the moment the last finishes), every request
    ``input`` tokens in and ``output`` out. Distinct prompts, so no prefix is shared (the
    measured engine caches none either)."""

    session_id: int
    rounds: int
    input: int
    output: int
    round: int = 0
    first_block: int | None = None  # where its prompts' blocks start (None: from its number)

    @property
    def done(self) -> bool:
        return self.round >= self.rounds

    def next_request(self) -> tuple[list[int], int]:
        blocks = -(-self.input // BLOCK)
        first = ((self.session_id * self.rounds + self.round) * blocks if self.first_block is None
                 else self.first_block + self.round * blocks)
        r = TraceRequest(0, 0.0, self.input, self.output, tuple(range(first, first + blocks)), None)
        return MooncakeTrace([r]).prompt(r), self.output

    def complete(self, output_ids: list[int]) -> None:
        self.round += 1


@dataclass(frozen=True)
class Replay:
    """A serving replay's measures: output tokens per second (generated tokens over the
    elapsed time), the median per-token latency (every gap between a request's successive
    tokens, its first token excluded: the measuring script's ``50%`` column, scored), and,
    shown with ``--replay``, the mean and 99th-percentile gap and the mean first-token
    latency (``FTL(ave)``)."""

    out_tps: float
    p50_token_s: float
    mean_token_s: float
    p99_token_s: float
    mean_first_token_s: float


def _replay(m: dict, max_len: int, hw: Hardware, tp: int, clients: list[_Client], loop: Loop,
            sim: SimOptions | None = None, **options: Any) -> LoopResult:
    """``clients`` run through the simulated engine of model ``m`` (a rows-file model) with
    the measured engine's ``options``: whole prompts (no chunking), no prefix cache."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(_hf_config(m, max_len)))
        engine = build_sim_engine(str(path), hw, tp=tp, sim=sim or SimOptions(), enable_prefix_caching=False,
                                  max_model_len=max_len, chunk_size=None, **options)
        return run_closed_loop(engine, clients.__getitem__, len(clients), loop)


def serving_replay(data: dict, row: dict, hw: Hardware) -> Replay:
    """A fixed-concurrency serving run replayed through the simulated engine (the real
    scheduler and KV cache on virtual time) with the measured engine's settings: its
    running-request cap, its KV pool (blocks x tokens per block, as pages of that size), its
    longest sequence and its prefill tokens per iteration, whole prompts (no chunking), no
    prefix cache. The clock starts when the clients do, as the measuring script's does."""
    clients = [_Client(i, row["rounds"], row["input"], row["output"])
               for i in range(row["concurrency"])]
    result = _replay(data["models"][row["model"]], row["session_len"], hw, row["tp"], clients,
                     Loop(token_times=True), max_num_seqs=row["max_batch"],
                     page_size=row["block_tokens"], num_pages=row["kv_blocks"],
                     max_prefill_tokens=row["max_context_tokens"])
    tokens = sum(r.output_tokens for r in result.records)
    assert tokens == row["concurrency"] * row["rounds"] * row["output"], row["id"]
    gaps = sorted(float(b - a) for r in result.records
                  for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False))
    first = statistics.fmean(r.first - r.start for r in result.records)
    return Replay(tokens / result.duration, gaps[int(0.5 * len(gaps))], statistics.fmean(gaps),
                  gaps[int(0.99 * len(gaps))], first)


def at_once_replay(data: dict, row: dict, hw: Hardware) -> float:
    """Output tokens per second of a run that sent all its requests at once (``request_rate``
    inf), replayed through the simulated engine with the measured engine's settings: each
    request its recorded prompt length and its recorded output length (at least one token: a
    request that returned only EOS counts 0), the KV pool from the stated share of device
    memory, whole prompts up to the prefill token budget, no prefix cache. The rate is the
    measuring script's: the recorded output tokens over the run's duration."""
    clients, first = [], 0
    for i, (n, out) in enumerate(zip(data["request_sets"][row["prompts"]], row["output_lens"],
                                     strict=True)):
        clients.append(_Client(i, 1, n, max(1, out), first_block=first))
        first += -(-n // BLOCK)
    result = _replay(data["models"][row["model"]], row["max_model_len"], hw, row["tp"], clients,
                     Loop(), SimOptions(mem_util=row["gpu_memory_utilization"]),
                     max_num_seqs=row["max_num_seqs"], page_size=row["block_tokens"],
                     max_prefill_tokens=row["max_num_batched_tokens"])
    assert all(r.success for r in result.records), row["id"]
    return sum(row["output_lens"]) / result.duration


def host_ms(cm: CostModel, row: dict) -> float:
    hw, n = cm.hw, row["batch"]
    return 1e3 * (hw.iter_overhead + hw.host_overhead + (hw.seq_overhead + hw.host_seq_overhead) * n)


def _overrides_for(row: dict, hw: Hardware, hw_override: dict) -> dict:
    """The overrides that apply to one row: plain keys to every row (the prefill-attention
    length terms to Hopper profiles only, where they were fitted), ``"<engine>:<field>"`` keys
    only to rows of that engine (a term of the measured engine's kernels, not of the cost
    model every engine shares)."""
    out: dict = {}
    alphas = []
    for k, v in hw_override.items():
        engine, _, name = k.rpartition(":")
        if engine and not row["engine"].startswith(engine):
            continue
        if (name.startswith("attn_len") or name == "attn_eta_compute") and hw.arch != "hopper":
            continue
        if name.startswith(AR_ALPHA):  # one all-reduce latency per device count
            alphas.append((int(name[len(AR_ALPHA):]), v / 1e6))
            continue
        out[name] = v
    if alphas:
        out["allreduce_alpha"] = tuple(sorted(alphas))
    return out


def row_hardware(data: dict, row: dict, hw_override: dict | None = None) -> Hardware:
    """The GPU profile a row is simulated on: the shipped one, with the measured engine's
    kernel settings read from its source (``engines`` in the rows file: not fitted, so
    before the corrections too), then the corrections that apply to the row."""
    hw = get_hardware(row["gpu"])
    for engine, known in data.get("engines", {}).items():
        if row["engine"].startswith(engine):
            hw = hw.replace(**known["hardware"])
    return hw.replace(**_overrides_for(row, hw, hw_override)) if hw_override else hw


def simulate(data: dict, row: dict, hw_override: dict | None = None) -> float:
    hw = row_hardware(data, row, hw_override)
    if row["kind"] == "attn_prefill_tflops":
        return attn_prefill_tflops(hw, row)
    if row["kind"] == "serving_out_tps":
        return serving_replay(data, row, hw).out_tps
    if row["kind"] == "serving_at_once_out_tps":
        return at_once_replay(data, row, hw)
    cm = CostModel(model_of(data, row["model"]), hw, row.get("tp", 1))
    fn = {"first_token_ms": first_token_ms, "static_batch_out_tps": static_batch_out_tps,
          "mixed_over_prefill": mixed_over_prefill, "attn_layer_ms": attn_layer_ms,
          "host_ms": host_ms}[row["kind"]]
    value = fn(cm, row)
    return value / row["tp"] if row.get("per_gpu") else value


STEP_GROUP = "serving: p50 token latency"
SERVING_KINDS = ("serving_out_tps", "serving_at_once_out_tps")  # the engine replays


def table_rows(data: dict, hw_override: dict | None = None, serving: bool = True) -> list[Result]:
    """Every row's result; a serving row gives two, its throughput and (where the source
    reports it) its median per-token latency, from the one replay."""
    out = []
    for r in data["rows"]:
        if r["kind"] in SERVING_KINDS and not serving:
            continue
        source = (f"{data['sources'][r['source']].split(' at ')[0].split(' (')[0]}: "
                  f"{r['where']} ({r['engine']})")
        if r["kind"] != "serving_out_tps":
            out.append(Result(r["id"], r["group"], r["split"], float(r["measured"]),
                              simulate(data, r, hw_override), r["unit"], source))
            continue
        rep = serving_replay(data, r, row_hardware(data, r, hw_override))
        out.append(Result(r["id"], r["group"], r["split"], float(r["measured"]), rep.out_tps,
                          r["unit"], source))
        if "p50_token_s" in r:
            out.append(Result(f"{r['id']}-p50", STEP_GROUP, r["split"], 1e3 * r["p50_token_s"],
                              1e3 * rep.p50_token_s, "ms (1 ms steps)", source + ", column 50%"))
    return out


# ---- the corrections, fitted on the rows marked ``fit`` ------------------------------------
# TensorRT-LLM's elementwise traffic, a term of that engine's kernels (its builds fuse norms,
# rope, activations and residual adds into neighbouring kernels; the cost model charges the
# unfused passes vLLM's kernels make): fitted on its first-token rows, applied to its rows only
TRT_ELEM = "TensorRT-LLM:elem_eta_mem"
# TurboMind's terms, fitted on its one-client rows and applied to its rows only: its host time
# per step (a C++ engine; the shipped 1 ms is hlserve's Python engine's) and its all-reduce
# latency at n devices, written "<engine>:allreduce_us_tp<n>" (microseconds). Vidur's NCCL fit
# (45-50 us on A100) times collectives launched one by one from Python; TurboMind launches
# NCCL from C++. Fitted on one-stream steps, the latency also takes up whatever else that step
# charges wrongly (docs/fidelity.md, item 6)
AR_ALPHA = "allreduce_us_tp"
TM = "LMDeploy TurboMind"
TM_HOST = f"{TM}:iter_overhead"
TTFT_ROWS = ["ttft-a100-7b-128", "ttft-a100-7b-2048", "ttft-a100-70b-128", "ttft-a100-70b-2048"]


def _fit(data: dict, ids: list[str], names: list[str], x0: list[float], lo: list[float],
         hi: list[float], fixed: dict[str, float] | None = None) -> dict[str, float]:
    """Least squares on log(simulated / measured) over the named rows (``fixed``: terms
    already fitted, held at their values)."""
    from scipy.optimize import least_squares

    rows = [r for r in data["rows"] if r["id"] in ids]

    def resid(x: np.ndarray) -> np.ndarray:
        ov = {**(fixed or {}), **dict(zip(names, map(float, x), strict=True))}
        return np.array([np.log(simulate(data, r, ov) / r["measured"]) for r in rows])

    res = least_squares(resid, x0=x0, bounds=(lo, hi))
    return dict(zip(names, (_round(float(v)) for v in res.x), strict=True))


def _round(v: float) -> float:
    """Four decimals, or four significant digits below 0.1 (a host time in seconds)."""
    return round(v, 4) if abs(v) >= 0.1 else float(f"{v:.4g}")


def fit_corrections(data: dict) -> dict[str, float]:
    """Prefill attention efficiency by length (Hopper only: FA3 rows 512, 2K, 8K) and decode
    attention bandwidth, one value for MHA and GQA models, on the one TensorRT-LLM row whose
    time is almost all decode attention and weight reads (Llama-2-7B, 60 x 128/2048), and
    TensorRT-LLM's elementwise traffic on its four first-token rows (applied to its rows only),
    then TurboMind's host time per step on its one-client rows at TP 1 and its all-reduce
    latency at TP 2 and TP 4 on its one-client rows there (applied to its rows only). Every
    serving row with 16-64 clients, the GQA rows and the other large-batch rows are held out:
    they test the single bandwidth and the engine terms on batches of 16-1280."""
    attn = _fit(data, ["attn-fa3-512", "attn-fa3-2k", "attn-fa3-8k"],
                ["attn_eta_compute", "attn_len_half"], [0.65, 300.0], [0.2, 0.0], [1.0, 1e5])
    fused = _fit(data, TTFT_ROWS, [TRT_ELEM], [0.5], [0.1], [100.0])
    decode = _fit(data, ["tput-a100-7b-60x128x2048"], ["attn_eta_mem"], [0.7], [0.1], [1.0],
                  fixed=fused)
    host = _fit(data, one_stream_rows(data, 1), [TM_HOST], [1e-3], [0.0], [5e-3],
                fixed={**fused, **decode})
    comm: dict[str, float] = {}
    for tp in (2, 4):
        comm |= _fit(data, one_stream_rows(data, tp), [f"{TM}:{AR_ALPHA}{tp}"], [30.0], [1.0],
                     [200.0], fixed={**fused, **decode, **host})
    return {**attn, **fused, **decode, **host, **comm}


def one_stream_rows(data: dict, tp: int) -> list[str]:
    """The serving rows marked ``fit``: one client at a time, so every step is one stream's
    decode step (no batching, no admission, no stalls), at ``tp`` devices."""
    return [r["id"] for r in data["rows"] if r["split"] == "fit"
            and r["kind"] == "serving_out_tps" and r["tp"] == tp and r["concurrency"] == 1]


def turbomind_allreduce(fixes: dict[str, float]) -> dict[int, tuple[float, float]]:
    """Per device count fitted: TurboMind's all-reduce latency (``fixes``:
    :func:`fit_corrections`) and the A100 profile's, seconds; their ratio is the scale
    benchmarks/sim_sensitivity.py and study_model_error.py put on the study's latency."""
    a100, prefix = get_hardware("A100"), f"{TM}:{AR_ALPHA}"
    ns = {k: int(k[len(prefix):]) for k in fixes if k.startswith(prefix)}
    return {n: (fixes[k] * 1e-6, a100.allreduce_params(n)[0]) for k, n in sorted(ns.items())}


# ---- GEMM rows the fits did not use ---------------------------------------------------------
def gemm_heldout() -> list[Result]:
    """Vidur GEMM profiles: (1) H100 refitted on TP 1-2 rows, scored on TP 4-8 rows (other
    shapes); (2) the A100 fit carried to H100 through the ridge point, scored on all H100
    rows."""
    from hlserve.sim.fitting import (
        VIDUR_GPUS,
        fit_gemm,
        gemm_time_np,
        load_vidur_ops,
    )
    out = []
    h100, _ = load_vidur_ops("h100")
    a100, _ = load_vidur_ops("a100")
    _, _, hp, hb = VIDUR_GPUS["h100"]
    _, _, ap, ab = VIDUR_GPUS["a100"]
    fit_mask = h100.tp <= 2
    part = _subset(h100, fit_mask)
    f = fit_gemm(part, hp, hb)
    rest = _subset(h100, ~fit_mask)
    pred = gemm_time_np(rest.n, rest.k, rest.m, hp, hb, f.eta_max, f.n_half, f.eta_mem, f.t_kernel)
    out += _gemm_results("gemm-h100-tp4-8", rest, pred, "Vidur H100 Llama-2-7B profile, TP 4/8 rows; fit on TP 1/2")
    fa = fit_gemm(a100, ap, ab)
    pred = gemm_time_np(h100.n, h100.k, h100.m, hp, hb, fa.eta_max, fa.ridge_frac * hp / hb,
                        fa.eta_mem, fa.t_kernel)
    out += _gemm_results("gemm-a100fit-on-h100", h100, pred, "Vidur H100 Llama-2-7B profile, all rows; fit on Vidur A100")
    return out


def _subset(s, mask):
    from hlserve.sim.fitting import OpSamples

    return OpSamples(*(getattr(s, f)[mask] for f in ("op", "n", "tp", "k", "m", "nbytes", "time")))


def _gemm_results(prefix: str, s, pred: np.ndarray, source: str) -> list[Result]:
    """One result per token bucket (median over the ops and TP degrees in it), so that the
    table stays readable: buckets 1-16, 17-128, 129-1024, 1025+ tokens."""
    out = []
    for lo, hi in ((1, 16), (17, 128), (129, 1024), (1025, 1 << 30)):
        m = (s.n >= lo) & (s.n <= hi)
        if not m.any():
            continue
        ratio = float(np.median(pred[m] / s.time[m]))
        worst = float(np.max(np.abs(pred[m] / s.time[m] - 1)))
        out.append(Result(f"{prefix}-n{lo}-{hi if hi < 1 << 30 else 'up'}", "gemm (held-out)", "heldout",
                          1.0, ratio, "median time ratio", f"{source}; {int(m.sum())} ops, worst |err| {worst:.0%}"))
    return out


# ---- summaries ------------------------------------------------------------------------------
def summary(results: list[Result]) -> dict[str, dict]:
    """Median and worst |error| per group, over the scored rows (``fit`` and ``heldout``), and
    over the held-out rows alone."""
    groups: dict[str, dict] = {}
    for g in dict.fromkeys(r.group for r in results):
        scored = [abs(r.error) for r in results if r.group == g and r.split in ("fit", "heldout")]
        held = [abs(r.error) for r in results if r.group == g and r.split == "heldout"]
        groups[g] = {"rows": len(scored), "median": statistics.median(scored) if scored else None,
                     "worst": max(scored) if scored else None,
                     "heldout_rows": len(held), "heldout_median": statistics.median(held) if held else None,
                     "heldout_worst": max(held) if held else None}
    return groups


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def markdown(before: list[Result], after: list[Result] | None = None) -> str:
    """The row table (before, and after the corrections when given), then the sources."""
    after_by = {r.id: r for r in after or []}
    head = "| row | group | split | measured | unit | simulated | error |"
    if after_by:
        head += " after: simulated | after: error |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in before:
        line = (f"| {r.id} | {r.group} | {r.split} | {r.measured:.4g} | {r.unit} | {r.simulated:.4g} | "
                f"{r.error:+.1%} |")
        if after_by:
            a = after_by.get(r.id)
            line += f" {a.simulated:.4g} | {a.error:+.1%} |" if a else " - | - |"
        lines.append(line)
    lines += ["", "| row | source (engine) |", "|---|---|"]
    lines += [f"| {r.id} | {r.source} |" for r in before]
    return "\n".join(lines)


def summary_markdown(groups: dict[str, dict], after: dict[str, dict] | None = None) -> str:
    head = "| group | scored rows | median abs err | worst abs err | held-out rows | held-out median | held-out worst |"
    if after:
        head += " after: median | after: worst | after: held-out median | after: held-out worst |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for g, s in groups.items():
        line = (f"| {g} | {s['rows']} | {_pct(s['median'])} | {_pct(s['worst'])} | {s['heldout_rows']} | "
                f"{_pct(s['heldout_median'])} | {_pct(s['heldout_worst'])} |")
        if after:
            a = after.get(g)
            line += (f" {_pct(a['median'])} | {_pct(a['worst'])} | {_pct(a['heldout_median'])} | "
                     f"{_pct(a['heldout_worst'])} |" if a else " - | - | - | - |")
        lines.append(line)
    return "\n".join(lines)


# ---- a check on the measured table itself ---------------------------------------------------
def prompt_cost(data: dict, results: list[Result]) -> list[dict]:
    """What a 128-token prompt costs a serving run, measured and replayed: a model's throughput
    with one-token prompts over its throughput with 128-token prompts at the same concurrency
    (the same 128 generated tokens a request, one short prefill more). Rows at 16-64 clients.
    A published ratio that breaks the pattern its neighbours share is an outlier of the
    measurement, not of the replay: no decode step makes a short prompt free at one
    concurrency and dear at the next (docs/fidelity.md, "The published table against itself")."""
    rows = {r["id"]: r for r in data["rows"] if r["kind"] == "serving_out_tps"}
    by_id = {r.id: r for r in results}
    out = []
    for rid, r in rows.items():
        if r["input"] != 1 or r["concurrency"] < 16 or rid not in by_id:
            continue
        key = (r["model"], r["tp"], r["concurrency"], r["output"])
        twin = next((s for s in rows.values() if s["input"] == 128
                     and (s["model"], s["tp"], s["concurrency"], s["output"]) == key), None)
        if twin is None or twin["id"] not in by_id:
            continue
        a, b = by_id[rid], by_id[twin["id"]]
        out.append({"model": r["model"], "tp": r["tp"], "clients": r["concurrency"],
                    "measured": a.measured / b.measured, "simulated": a.simulated / b.simulated})
    order = list(data["models"])
    return sorted(out, key=lambda p: (order.index(p["model"]), p["clients"]))


def prompt_cost_markdown(pairs: list[dict]) -> str:
    lines = ["| model | TP | clients | measured: 1/128 over 128/128 | replayed | replay / measured - 1 |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {p['model']} | {p['tp']} | {p['clients']} | {p['measured']:.3f} | {p['simulated']:.3f} | "
              f"{p['simulated'] / p['measured'] - 1:+.1%} |" for p in pairs]
    return "\n".join(lines)


def run(hw_override: dict | None = None, gemm: bool = True,
        serving: bool = True) -> tuple[list[Result], dict[str, dict]]:
    results = table_rows(load(), hw_override, serving)
    if gemm:
        results += gemm_heldout()
    return results, summary(results)


def _rows_json(results: list[Result], groups: dict[str, dict]) -> dict:
    return {"rows": [{**r.__dict__, "error": r.error} for r in results], "groups": groups}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write rows and summary to this file")
    p.add_argument("--no-gemm", action="store_true", help="skip the Vidur GEMM rows")
    p.add_argument("--no-serving", action="store_true", help="skip the serving replays")
    p.add_argument("--replay", metavar="ROW", help="replay one serving row with the fitted "
                   "corrections and print its token-latency measures, then stop")
    p.add_argument("--part", choices=("both", "before", "after"), default="both",
                   help="the shipped profiles, the fitted corrections, or both (the two halves "
                   "run in parallel processes this way: tests/test_fidelity.py)")
    args = p.parse_args(argv)
    if args.replay:
        data = load()
        row = next(r for r in data["rows"] if r["id"] == args.replay)
        rep = serving_replay(data, row, row_hardware(data, row, fit_corrections(data)))
        print(json.dumps({"row": row["id"], **rep.__dict__}, indent=1))
        return 0
    out: dict = {}
    results = groups = after = after_groups = None
    if args.part != "after":
        results, groups = run(gemm=not args.no_gemm, serving=not args.no_serving)
        out["before"] = _rows_json(results, groups)
    if args.part != "before":
        fixes = fit_corrections(load())
        after, after_groups = run(fixes, gemm=False, serving=not args.no_serving)
        print(f"Corrections fitted on the rows marked 'fit': {fixes}\n")
        out["corrections"], out["after"] = fixes, _rows_json(after, after_groups)
    if groups is not None:
        print(summary_markdown(groups, after_groups))
        print()
        print(markdown(results, after))
    else:
        print(summary_markdown(after_groups))
    if after is not None and not args.no_serving:
        print("\nWhat a 128-token prompt costs a serving run (docs/fidelity.md, "
              "\"The published table against itself\"):\n")
        print(prompt_cost_markdown(prompt_cost(load(), after)))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
