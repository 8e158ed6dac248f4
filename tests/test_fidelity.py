"""benchmarks/fidelity.py: the simulator against public GPU measurements stays within the
bounds docs/fidelity.md states, so a cost-model change that breaks fidelity fails here."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from hlserve.sim.cost import CostModel, IterationShape
from hlserve.sim.hardware import HARDWARE
from hlserve.sim.model_specs import MODELS

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fidelity", ROOT / "benchmarks" / "fidelity.py")
assert _spec and _spec.loader
fidelity = importlib.util.module_from_spec(_spec)
sys.modules["fidelity"] = fidelity  # dataclasses look their module up
_spec.loader.exec_module(fidelity)

# the bounds docs/fidelity.md reports (before: the shipped profiles; after: the corrections)
BEFORE = {  # group: (median, worst) over the scored rows
    "single-request": (0.10, 0.15),
    "attention (FA3, H100)": (0.12, 0.22),
    "large-batch decode": (0.18, 0.23),
    "serving": (0.11, 0.30),
    "serving: p50 token latency": (0.15, 0.33),  # InternLM-20B at TP 2: Vidur's all-reduce
    "mixed-batch": (0.05, 0.05),
    "serving at once": (0.05, 0.13),  # vLLM, 640 requests in flight, TP 1 and 4, A100 and H100
}
AFTER = {  # group: (held-out median, held-out worst)
    "attention (FA3, H100)": (0.03, 0.03),
    "large-batch decode": (0.10, 0.15),  # the bound, met
    # worst: not met, the measured engine's stalls at 16-64 clients, which the step does not
    # carry (docs/fidelity.md, "Against the bounds"); the step itself is the next line
    "serving": (0.05, 0.40),
    "serving: p50 token latency": (0.05, 0.10),
    # worst: not met, Llama-3-8B on H100 (+16.7%): the decode bandwidth fitted on
    # TensorRT-LLM's kernel is faster than vLLM's (docs/fidelity.md, "Serving at once")
    "serving at once": (0.07, 0.17),
}


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict, list[dict]]:
    """The whole suite but the GEMM rows (their own test below), most of it the serving
    replays: the shipped profiles here, the corrections in the script itself (``--part
    after``) in a second process at the same time, so two cores take half the time. The
    in-process fit the script's corrections are checked against runs while the script does
    (the script's part is the longer: its own fit, then every row again)."""
    out = tmp_path_factory.mktemp("fidelity") / "after.json"
    script = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "fidelity.py"),
                               "--part", "after", "--no-gemm", "--json", str(out)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _, before = fidelity.run(gemm=False)
        corrections = fidelity.fit_corrections(fidelity.load())
        _, err = script.communicate(timeout=900)
    finally:
        script.kill()
    assert script.returncode == 0, err[-2000:]
    got = json.loads(out.read_text())
    assert got["corrections"] == corrections
    return before, got["after"]["groups"], got["corrections"], got["after"]["rows"]


def test_every_row_names_its_source_engine_and_split() -> None:
    data = fidelity.load()
    assert len(data["rows"]) >= 30
    for r in data["rows"]:
        assert r["source"] in data["sources"], r["id"]
        assert r["where"] and r["engine"], r["id"]
        assert r["split"] in ("fit", "heldout", "other-kernel", "other-engine", "suspect"), r["id"]
    ids = [r["id"] for r in data["rows"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("group", sorted(BEFORE))
def test_shipped_profiles_within_stated_bounds(suite, group: str) -> None:
    before, *_ = suite
    med, worst = BEFORE[group]
    assert before[group]["median"] <= med, before[group]
    assert before[group]["worst"] <= worst, before[group]


@pytest.mark.parametrize("group", sorted(AFTER))
def test_corrections_within_stated_bounds_on_heldout_rows(suite, group: str) -> None:
    _, after, *_ = suite
    med, worst = AFTER[group]
    assert after[group]["heldout_median"] <= med, after[group]
    assert after[group]["heldout_worst"] <= worst, after[group]


def test_corrections_move_the_rows_they_target(suite) -> None:
    """The fitted terms improve the FA3 rows, and the one decode bandwidth fitted on one MHA
    row improves the held-out large-batch decode and serving medians; without them (the
    shipped profiles) the FA3 held-out worst is 12.5%."""
    before, after, fixes, _ = suite
    assert 0.4 < fixes["attn_eta_compute"] < 0.9 and fixes["attn_len_half"] > 0
    assert 0.8 < fixes["attn_eta_mem"] <= 1.0
    assert after["attention (FA3, H100)"]["heldout_worst"] < before["attention (FA3, H100)"]["heldout_worst"] / 4
    assert after["large-batch decode"]["heldout_median"] < before["large-batch decode"]["heldout_median"]
    assert after["serving"]["heldout_median"] < 0.7 * before["serving"]["heldout_median"]
    assert after["serving: p50 token latency"]["heldout_median"] < (
        0.7 * before["serving: p50 token latency"]["heldout_median"])
    # TensorRT-LLM moves fewer elementwise bytes than the unfused passes (A100's 0.4456 of
    # bandwidth); fitted on its four first-token rows, it brings them within 10%
    assert fixes[fidelity.TRT_ELEM] > 2 * HARDWARE["A100"].elem_eta_mem
    assert after["single-request"]["heldout_rows"] == 0 and after["single-request"]["worst"] <= 0.10
    # TurboMind's one-client rows: a C++ engine's host step is under hlserve's 1 ms, and its
    # all-reduce waits less than Vidur's NCCL fit (collectives launched from Python) at TP 2
    # and 4; with them the held-out step (median token gap, 16-64 clients) is within 10%
    assert 0 < fixes[fidelity.TM_HOST] < HARDWARE["A100"].iter_overhead
    for tp in (2, 4):
        alpha = fixes[f"{fidelity.TM}:{fidelity.AR_ALPHA}{tp}"] * 1e-6
        assert 0 < alpha < HARDWARE["A100"].allreduce_params(tp)[0]
    assert before["serving: p50 token latency"]["heldout_worst"] > 0.25


def test_serving_at_once_rows_replay_every_recorded_request(suite) -> None:
    """The vLLM runs that sent 640 ShareGPT requests at once: every request is replayed with its
    recorded prompt and output length (the lengths sum to the run's recorded totals), at TP 1
    and 4 on A100 and H100, none used in a fit; the shipped profiles meet the issue's serving
    bound there (median <= 10%, worst <= 15%)."""
    data = fidelity.load()
    prompts = data["request_sets"]["lambda-sharegpt-640"]
    assert len(prompts) == 640 and sum(prompts) == 129604
    rows = [r for r in data["rows"] if r["kind"] == "serving_at_once_out_tps"]
    assert {(r["gpu"], r["tp"]) for r in rows} == {("A100", 1), ("H100", 1), ("A100", 4), ("H100", 4)}
    for r in rows:
        assert r["split"] == "heldout" and len(r["output_lens"]) == len(prompts)
        assert f"= {sum(r['output_lens'])} tokens /" in r["where"]
    before, _, _, after_rows = suite
    assert before["serving at once"]["heldout_rows"] == 4
    assert before["serving at once"]["heldout_median"] <= 0.10
    assert before["serving at once"]["heldout_worst"] <= 0.15
    assert {r["id"] for r in after_rows if r["group"] == "serving at once"} == {r["id"] for r in rows}


def test_allreduce_sensitivity_scales_by_the_fitted_ratios(suite) -> None:
    """benchmarks/sim_sensitivity.py --term allreduce scales the study's 8-GPU latency by
    TurboMind's fitted latency over the A100 profile's at 2 and 4 GPUs (docs/study.md,
    section 5): both shorter than the profile's, the 2-GPU one most."""
    _, _, fixes, _ = suite
    ratios = {n: fitted / profile
              for n, (fitted, profile) in fidelity.turbomind_allreduce(fixes).items()}
    assert set(ratios) == {2, 4}
    assert 0 < ratios[2] < ratios[4] < 1


def test_prompt_cost_the_replay_and_the_published_outlier(suite) -> None:
    """What a 128-token prompt costs a serving run (throughput at 1/128 over 128/128, same
    model and clients; docs/fidelity.md, "The published table against itself"): the replay
    gives it within 3% at the median of the twelve pairs at 16-64 clients, and the published
    7B pair at 32 clients is out of line with the table itself, cheaper than at 7B's 16 and 64
    clients and than any other model's at 32, whatever the simulator says."""
    *_, rows = suite
    names = [f.name for f in dataclasses.fields(fidelity.Result)]
    results = [fidelity.Result(**{k: r[k] for k in names}) for r in rows]
    pairs = fidelity.prompt_cost(fidelity.load(), results)
    assert len(pairs) == 12
    assert statistics.median(abs(p["simulated"] / p["measured"] - 1) for p in pairs) <= 0.03
    cost = {(p["model"], p["clients"]): p["measured"] for p in pairs}
    odd = cost["Llama-2-7B", 32]
    assert odd < min(cost["Llama-2-7B", 16], cost["Llama-2-7B", 64])
    assert odd < min(c for (m, n), c in cost.items() if n == 32 and m != "Llama-2-7B")
    for model in {m for m, _ in cost} - {"Llama-2-7B"}:  # the pattern the outlier breaks
        assert cost[model, 16] < cost[model, 32] < cost[model, 64], model


def test_an_engine_term_reaches_only_that_engines_rows() -> None:
    """``"<engine>:<field>"`` corrections change that engine's rows and no other's: the
    TensorRT-LLM elementwise term moves its static-batch row, not a TurboMind serving row's
    hardware, and plain keys reach every row."""
    data = fidelity.load()
    trt = next(r for r in data["rows"] if r["id"] == "tput-a100-7b-384x128x128")
    tm = next(r for r in data["rows"] if r["id"] == "serve-a100-7b-c64-128x128")
    fix = {fidelity.TRT_ELEM: 1.5, "attn_eta_mem": 0.9, fidelity.TM_HOST: 3e-4,
           f"{fidelity.TM}:{fidelity.AR_ALPHA}4": 20.0, f"{fidelity.TM}:{fidelity.AR_ALPHA}2": 9.0}
    assert fidelity.row_hardware(data, trt, fix).elem_eta_mem == 1.5
    assert fidelity.row_hardware(data, tm, fix).elem_eta_mem == HARDWARE["A100"].elem_eta_mem
    assert fidelity.row_hardware(data, tm, fix).attn_eta_mem == 0.9
    # TurboMind's terms: its host step, its all-reduce latencies (microseconds, by device count)
    assert fidelity.row_hardware(data, tm, fix).iter_overhead == 3e-4
    assert fidelity.row_hardware(data, tm, fix).allreduce_alpha == ((2, 9e-6), (4, 2e-5))
    assert fidelity.row_hardware(data, trt, fix).allreduce_alpha == ()
    assert fidelity.row_hardware(data, trt, fix).iter_overhead == HARDWARE["A100"].iter_overhead
    assert fidelity.simulate(data, trt, fix) > fidelity.simulate(data, trt, {"attn_eta_mem": 0.9})


def test_corrections_off_by_default_leave_the_cost_model_unchanged() -> None:
    """The length term at 0 gives the exact seconds of the term before it (stored study
    points rerun bit-identical); set, it slows prefill attention (efficiency below
    ``attn_eta_compute`` at any finite length)."""
    hw = HARDWARE["H20"]
    assert hw.attn_len_half == 0 and hw.attn_eta_mem == 0.70
    cm = CostModel(MODELS["Qwen2.5-32B"], hw, 8)
    shape = IterationShape(4096 + 64, 65, 64, ((4096, 8192),), 64, 64 * 30000, 30000)
    base = cm.iteration(shape)[0]
    on = CostModel(MODELS["Qwen2.5-32B"], hw.replace(attn_len_half=200.0), 8)
    assert on.iteration(shape)[0] > base


def test_serving_replay_runs_the_measured_engines_settings() -> None:
    """The replay submits every request of every client (C x rounds x output tokens) and
    honours the row's KV pool: a pool too small for the concurrency queues requests."""
    data = fidelity.load()
    row = next(r for r in data["rows"] if r["id"] == "serve-a100-7b-c64-128x128")
    row = {**row, "concurrency": 16, "rounds": 2}
    hw = HARDWARE["A100"]
    full = fidelity.serving_replay(data, row, hw)
    tight = fidelity.serving_replay(data, {**row, "kv_blocks": 8}, hw)  # 4 sequences of 256
    assert tight.out_tps < full.out_tps / 2
    # the median token gap is a decode step of the whole batch (16 at ~128 + 64 tokens)
    step = CostModel(fidelity.model_of(data, row["model"]), hw).decode(16, 192).total
    assert full.p50_token_s == pytest.approx(step, rel=0.05)
    assert tight.p50_token_s < full.p50_token_s


def test_gemm_heldout_rows() -> None:
    rows = fidelity.gemm_heldout()
    assert len(rows) == 8
    big = [abs(r.error) for r in rows if not r.id.endswith("n1-16")]
    assert max(big) <= 0.10, [(r.id, r.error) for r in rows]


def test_script_runs_whole(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fidelity.py"), "--no-serving",
                    "--json", str(out)], check=True, capture_output=True, timeout=300)
    got = json.loads(out.read_text())
    assert set(got) == {"before", "corrections", "after"}
    assert got["before"]["groups"]["single-request"]["rows"] == 4


def test_model_error_perturbations_come_from_the_suite_residuals() -> None:
    """benchmarks/study_model_error.py draws its perturbations from the suite's residuals:
    each term moves by one of them, in the direction the residual's sign says."""
    spec = importlib.util.spec_from_file_location("study_model_error",
                                                  ROOT / "benchmarks" / "study_model_error.py")
    assert spec and spec.loader
    sme = importlib.util.module_from_spec(spec)
    sys.modules["study_model_error"] = sme
    spec.loader.exec_module(sme)
    from hlserve.study.model_error import draw

    terms = {t.name: t for t in sme.terms()}
    assert len(terms["attention prefill"].residuals) == 3
    assert len(terms["attention decode"].residuals) == 2
    base = HARDWARE["H20"]
    hw = draw(base, list(terms.values()), 0, 1).hardware
    for e in terms["attention decode"].residuals:  # decode rows simulated slow: the real kernel is faster
        assert e > 0
    assert hw.attn_eta_mem > base.attn_eta_mem
    assert any(abs(hw.attn_eta_compute - base.attn_eta_compute / (1 + e)) < 1e-12
               for e in terms["attention prefill"].residuals)
    for e in terms["host overhead"].residuals:  # vLLM's host path is slower than hlserve's terms
        assert e < 0
    assert hw.iter_overhead > base.iter_overhead
