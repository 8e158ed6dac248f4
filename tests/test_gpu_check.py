"""benchmarks/gpu_check.py, the script a lent GPU runs once, runs whole on the CPU: its
correctness check passes and it prints the speed table and the roofline line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_cpu(tmp_path: Path) -> None:
    result = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
         "--size", "tiny", "--quick", "--models", str(tmp_path), "--batch", "2",
         "--prompt-len", "40", "--decode-len", "4", "--prefill-len", "64",
         "--kv-cache-gb", "0.05", "--bandwidth", "2e10", "--result-file", str(result)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| decode, 2 x 40 in, 4 out (output tok/s) |" in proc.stdout
    assert "of the bandwidth roofline" in proc.stdout
    out = json.loads(result.read_text())
    assert out["correctness"] and all(v.split("/")[0] == v.split("/")[1]
                                      for v in out["correctness"].values())
    assert 0 < out["roofline"]["fraction"] < 1.5
    assert out["throughput"]["hlserve"]["prefill_tok_s"] > 0
