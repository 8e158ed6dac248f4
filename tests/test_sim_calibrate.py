"""Calibration on the machine at hand, checked against a real run of a different workload.

The real runs are on a loaded, shared CPU, so the bounds are looser than the 10% aim
(docs/study.md reports the measured errors)."""

from __future__ import annotations

import json

import pytest

from hlserve.cli.simulate import main as sim_main
from hlserve.sim.hardware import Hardware
from hlserve.study.calibrate import FIDELITY_OPTIONS, calibrate, fidelity, write_profile


@pytest.mark.slow
def test_calibrate_then_predict_a_different_workload(tiny_model_dirs, tmp_path, capsys) -> None:
    model = str(tiny_model_dirs["qwen2"])

    # a different workload: longer prompts, more sessions, throughput mode (calibration used
    # the vllm preset and shorter prompts)
    def within(rep: dict) -> bool:
        return (rep["per_iteration"]["median_abs_err"] < 0.30
                and abs(rep["per_iteration"]["sum_err"]) < 0.25
                and abs(rep["end_to_end"]["throughput_err"]) < 0.25)

    # Timings are CPU time of this process, but a shared machine's other jobs still slow it
    # (caches, SMT siblings). Either side can be the disturbed one: in one CI run three
    # fidelity runs in a row failed the bound, the last 14% faster than the profile
    # (machine_drift 0.88: the calibration was measured while the machine was slow) with a
    # drift-corrected throughput error of 2%. Rerunning against the same profile cannot mend
    # that, so each try calibrates afresh (a few seconds) and then runs the workload.
    for _ in range(3):
        cal = calibrate(model, quick=True)
        rep = fidelity(model, cal.hardware)
        if within(rep):
            break
    hw = cal.hardware
    assert hw.arch == "cpu" and hw.dtype_bytes == 4 and hw.peak_flops > 1e9
    assert cal.report["gemm_fit"]["median_err"] < 0.3
    assert cal.report["iteration_fit"]["median_err"] < 0.15
    assert rep["engine_options"] == FIDELITY_OPTIONS
    assert rep["iterations"]["real"] > 50
    assert within(rep), json.dumps(rep, indent=1, default=str)
    path = tmp_path / "cpu.json"
    write_profile(cal, path)
    assert Hardware.load(path) == hw
    # the profile is a hardware profile like the built-in ones
    assert sim_main(["cost", "--hardware", str(path), "--model", model, "--decode-batch", "8",
                     "--context", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0.1 < out["total_ms"] < 1000
