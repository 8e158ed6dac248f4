"""vLLM's and SGLang's own schedulers as study systems (hlserve.study.foreign,
hlserve.integrations.sim_engine): stored points rerun bit-identical in each engine's
environment, the tables of docs/study/h20-systems/ agree with the stored points, and every
system's steps are priced as hlserve's own are."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hlserve.study.core import StudyPoint, StudySpec, run_point
from hlserve.study.foreign import FOREIGN, ForeignRunError, missing_environments

ROOT = Path(__file__).resolve().parent.parent
STORED = ROOT / "docs" / "study" / "h20-systems" / "points"
# the overload cell (64K, 128 sessions: about twice the KV pool): where admission,
# preemption, ordering and the plugins' budgets all act, and the fastest to simulate
# (~15-60 s a point)
RERUN = ("vllm-0.34", "vllm-0.34+hlserve", "sglang-0.5.23", "sglang-0.5.23+hlserve")


def _rerun(system: str) -> tuple[dict, dict] | str:
    missing = missing_environments((system,))
    if missing:
        return missing[0]
    stored = json.loads((STORED / f"ctx65536_n128_{system}_inf.json").read_text())
    spec = StudySpec(**stored["spec"])
    return stored, json.loads(json.dumps(run_point(spec, StudyPoint(**stored["point"]))))


@pytest.fixture(scope="module")
def reruns() -> dict[str, tuple[dict, dict] | str]:
    # two at a time: each is a child process in its engine's environment
    with ThreadPoolExecutor(2) as ex:
        return dict(zip(RERUN, ex.map(_rerun, RERUN), strict=True))


@pytest.mark.parametrize("system", RERUN)
def test_stored_engine_point_reruns_bit_identical(system: str, reruns) -> None:
    got = reruns[system]
    if isinstance(got, str):
        pytest.skip(got)
    stored, rec = got
    assert rec["options"] == stored["options"]
    assert rec["kv_pool_tokens"] == stored["kv_pool_tokens"]
    new, old = dict(rec["metrics"]), dict(stored["metrics"])
    new.pop("wall_s")
    old.pop("wall_s")
    assert json.dumps(new) == json.dumps(old)


def test_a_missing_environment_is_named_with_how_to_build_it(monkeypatch) -> None:
    monkeypatch.setenv("HLSERVE_SGLANG_PYTHON", "/nonexistent/python")
    point = StudyPoint("sglang-0.5.23+hlserve", None, 32768, 16)
    with pytest.raises(ForeignRunError, match=r"\.ci/sglang-env"):
        run_point(StudySpec(duration=10.0, warmup=0.0), point)


def test_the_study_command_names_a_missing_environment_before_running(monkeypatch, tmp_path,
                                                                    capsys) -> None:
    from hlserve import cli

    monkeypatch.setenv("HLSERVE_VLLM_0_34_0_PYTHON", "/nonexistent/python")
    rc = cli.main(["study", "--systems", "vllm-0.34", "--contexts", "32768", "--sessions", "16",
                   "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "vllm-harness-env 0.34.0" in err and "Traceback" not in err
    assert not list(tmp_path.glob("points/*.json"))


def test_the_engines_systems_are_the_point_runners():
    from hlserve.integrations.sim_point import BUILDERS

    assert set(BUILDERS) == set(FOREIGN)
    assert StudyPoint("vllm-0.34", None, 32768, 16).label == "vllm-0.34"
    assert StudyPoint("vllm-0.34", 4096, 32768, 16).label == "vllm-0.34 B=4096"
    assert StudyPoint("sglang-0.5.23-mixed", 512, 32768, 16).label == "sglang-0.5.23-mixed C=512"
    assert StudyPoint("vllm-0.34-chunked", 2048, 32768, 16).label == "vllm-0.34-chunked C=B=2048"


def test_other_engines_steps_are_priced_as_hlserves() -> None:
    """The segments an engine's scheduler reports (new tokens, tokens before, samples) give
    the shape hlserve's own batch gives, so both are priced by one cost model alike: one
    real step of hlserve's scheduler holding a prefill chunk, a whole prompt and a decode."""
    from hlserve.request import SamplingParams
    from hlserve.sim.build import build_sim_engine
    from hlserve.sim.cost import shape_from, shape_of

    engine = build_sim_engine("Qwen2.5-32B", "H20", tp=8, chunk_size=64, mixing="always",
                              max_model_len=4096)
    engine.add_request(list(range(10, 40)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # the first prompt's prefill: it decodes from now on
    engine.add_request(list(range(100, 300)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request(list(range(300, 320)), SamplingParams(max_tokens=8, ignore_eos=True))
    seen = []
    execute = engine.runner.execute

    def spy(batch):
        segments = [(s.num_tokens, s.start, s.start + s.num_tokens == s.request.num_tokens)
                    for s in batch.seqs]
        seen.append((segments, shape_of(batch)))
        return execute(batch)

    engine.runner.execute = spy
    engine.step()
    segments, shape = seen[0]
    assert {(q == 1 and start > 0, samples) for q, start, samples in segments} == {
        (True, True), (False, False), (False, True)}  # a decode, a chunk, a whole prompt
    assert shape_from(segments) == shape


def test_systems_tables_agree_with_the_stored_points() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "study_systems.py"), "--check"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("in_full", [False, True])
def test_sglang_reservation_of_fixed_length_requests(in_full: bool) -> None:
    """SGLang 0.5.23 reserves a running ignore_eos request's whole remaining output
    (schedule_policy.py: "fixed-length requests cannot benefit from the early-EOS estimate");
    ``reserve_fixed_length_in_full`` does, the stored study's preset reserves the
    new-token ratio of it. A request that may stop early is reserved at the ratio either way."""
    from hlserve.request import SamplingParams
    from hlserve.sim.build import build_sim_engine

    engine = build_sim_engine("Qwen2.5-32B", "H20", tp=8, preset="sglang", max_model_len=4096,
                              reserve_fixed_length_in_full=in_full)
    engine.add_request(list(range(10, 110)), SamplingParams(max_tokens=1001, ignore_eos=True))
    engine.add_request(list(range(200, 300)), SamplingParams(max_tokens=1001))
    engine.step()  # both prefilled: running, one token out each
    s = engine.scheduler
    ratio_part = int(1000 * s.new_token_ratio)
    want = -(-(1000 + ratio_part if in_full else int(2000 * s.new_token_ratio)) // 16)
    assert s.new_token_ratio < 1.0 and s._reserved_pages() == want
