"""The human tax on a production engine: ``hlserve sweep --server-cmd`` over vLLM's CPU build.

    python benchmarks/peers/vllm_sweep.py                       # the committed run, docs/vllm_tax
    python benchmarks/peers/vllm_sweep.py --chunk-sizes 256,1024,4096 --repeats 3 --out DIR

Each point is a fresh vLLM server (the same build, model and runtime as run_peers.py: the
Qwen2.5-0.5B shape in bf16, tcmalloc + iomp preloaded, threads bound to both cores) running
the same closed-loop agent workload; the grid is vLLM's own two knobs,

- C, the per-request prefill chunk: ``--long-prefill-token-threshold`` (vLLM V1 caps each
  request's new tokens per step at it), and
- B, the per-step token budget: ``--max-num-batched-tokens``,

plus one more point: the same vLLM with hlserve's scheduler plugin (``--scheduler-cls
hlserve.integrations.vllm.ThroughputScheduler``, budget cap = the model length). No cap is
the model length (4096), listed as a number: vLLM has no word for it. Points run interleaved, ``--repeats`` times, after
one excluded warm-up run; the tax table and frontier carry 95% intervals (docs/bench.md,
"Repeats and intervals"). Everything else is ``hlserve sweep``'s (its --help).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_peers: a sibling script
from run_peers import (
    PLUGIN_ARGS,
    ROOT,
    ensure_model,
    ensure_plugin,
    ensure_vllm,
    vllm_env,
)


def server_template(py: Path, max_len: int, kv_gib: int) -> str:
    env = [f"{k}={v}" for k, v in vllm_env(py, kv_gib).items()]
    return (f"env {shlex.join(env)} {shlex.quote(str(py))} -m vllm.entrypoints.openai.api_server "
            "--model {model} --host {host} --port {port} --served-model-name m "
            f"--dtype bfloat16 --max-model-len {max_len} "
            "--max-num-batched-tokens {token_budget} --long-prefill-token-threshold {chunk_size} "
            "{args}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk-sizes", default=None,
                    help="C values (default: 512,2048 and the model length, vLLM's no cap)")
    ap.add_argument("--token-budgets", default="same")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-gib", type=int, default=4)
    ap.add_argument("--model-dir", type=Path, default=ROOT / "models" / "qwen2-0.5b-bf16")
    ap.add_argument("--vllm-venv", type=Path,
                    default=Path.home() / ".cache" / "hlserve" / "venv-vllm")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "vllm_tax")
    args, rest = ap.parse_known_args()
    py = ensure_vllm(args.vllm_venv)
    ensure_plugin(py)
    model = ensure_model(args.model_dir)
    cmd = [sys.executable, "-m", "hlserve.cli", "sweep", "--model", str(model),
           "--server-cmd", server_template(py, args.max_model_len, args.kv_gib),
           "--served-model-name", "m",
           "--chunk-sizes", args.chunk_sizes or f"512,2048,{args.max_model_len}", "--token-budgets", args.token_budgets,
           "--add-point", "vllm-hlserve=" + shlex.join(PLUGIN_ARGS),
           "--sessions", str(args.sessions), "--rounds", str(args.rounds),
           "--system-prompt-len", "1024", "--task-len", "128", "--tool-output-len", "128:384",
           "--output-len", "32:96", "--repeats", str(args.repeats),
           "--title", "vLLM 0.32 (CPU build), Qwen2.5-0.5B shape, agent sessions",
           "--out", str(args.out), *rest]
    print("+", shlex.join(cmd), flush=True)
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
