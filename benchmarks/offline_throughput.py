"""Offline throughput: hlserve against Hugging Face transformers ``generate``, side by side.

Both run in this one process on the same random-weight model (Qwen2.5-0.5B shape by default)
and the same prompts with fixed output lengths (``ignore_eos``), one after the other, so the
printed ratio is measured under the same machine load. transformers runs static batches
(left-padded, ``--hf-batch-size`` prompts at a time, in the given order); hlserve runs
continuous batching over the whole set.

    python benchmarks/offline_throughput.py                    # 64 prompts, 256-1024 in, 128 out
    python benchmarks/offline_throughput.py --num-prompts 16 --size tiny   # a quick look
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # random ids from the tokenizer's range: no two prompts share a prefix page
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_hlserve(model_dir: Path, prompts: list[list[int]], out_len: int, args: argparse.Namespace) -> float:
    from hlserve import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=args.dtype, kv_cache_gb=args.kv_cache_gb,
              token_budget=args.token_budget, chunk_size=args.chunk_size)
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert all(len(o.token_ids) == out_len for o in outs)
    return elapsed


def run_transformers(model_dir: Path, prompts: list[list[int]], out_len: int, args: argparse.Namespace) -> float:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    pad = 0

    def batch_generate(batch: list[list[int]], n: int) -> torch.Tensor:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        return model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=pad,
        )

    with torch.inference_mode():
        batch_generate(prompts[:2], 2)  # warm-up
        t0 = time.perf_counter()
        bs = args.hf_batch_size
        for i in tqdm(range(0, len(prompts), bs), desc="transformers", unit="batch"):
            out = batch_generate(prompts[i : i + bs], out_len)
            assert out.shape[1] - max(len(p) for p in prompts[i : i + bs]) == out_len
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: build the random one)")
    ap.add_argument("--size", default="0.5b", choices=["tiny", "0.5b"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=[256, 1024], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--kv-cache-gb", type=float, default=4.0)
    ap.add_argument("--token-budget", type=int, default=None)
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads for both engines (default: torch's choice)")
    ap.add_argument("--result-file", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = args.model
    if model_dir is None:
        from hlserve.models.tiny import make_tiny_model

        model_dir = Path("models") / f"qwen2-{args.size}-{args.dtype}"
        if not (model_dir / "config.json").exists():
            make_tiny_model(model_dir, arch="qwen2", size=args.size, dtype=args.dtype)
    from hlserve.models.model_config import ModelConfig

    vocab = min(ModelConfig.from_dir(model_dir).vocab_size, 4096)
    prompts = make_prompts(args.num_prompts, *args.input_len, vocab, args.seed)
    n_in = sum(len(p) for p in prompts)
    n_out = args.output_len * len(prompts)
    print(f"model {model_dir} ({args.dtype}), {len(prompts)} prompts, {n_in} prompt tokens, "
          f"{n_out} output tokens, {torch.get_num_threads()} threads")

    results = {}
    t = run_hlserve(model_dir, prompts, args.output_len, args)
    results["hlserve"] = t
    if not args.skip_transformers:
        results["transformers"] = run_transformers(model_dir, prompts, args.output_len, args)
    print()
    print(f"{'engine':<14}{'seconds':>10}{'total tok/s':>14}{'output tok/s':>14}")
    for name, t in results.items():
        print(f"{name:<14}{t:>10.1f}{(n_in + n_out) / t:>14.1f}{n_out / t:>14.1f}")
    if "transformers" in results:
        ratio = results["transformers"] / results["hlserve"]
        print(f"\nhlserve / transformers throughput: {ratio:.2f}x")
        results["ratio"] = ratio
    if args.result_file:
        args.result_file.write_text(json.dumps(
            {"num_prompts": len(prompts), "total_input_tokens": n_in, "total_output_tokens": n_out,
             "dtype": args.dtype, "seconds": results}, indent=2))


if __name__ == "__main__":
    main()
