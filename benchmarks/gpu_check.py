"""One prepared check of the engine on a GPU: correctness, speed against transformers, and the
decode step against the memory-bandwidth roofline. Under 8 minutes on one H200.

    python benchmarks/gpu_check.py                       # CUDA, Qwen2.5-7B shape, bf16
    python benchmarks/gpu_check.py --device cpu --size tiny --quick   # the same code on a CPU

1. **Greedy correctness**: the embedded tiny models (llama, qwen2, qwen3) in fp32, hlserve
   against a plain transformers forward per token, unchunked, chunk 16 and page size 1, with a
   prefix-cache hit; prints how many prompts give identical tokens (all, on a CPU).
2. **Throughput** of a random-weight model of the Qwen2.5-7B shape in bf16 (built on first
   use, ~15 GB; ``--size tiny|0.5b`` for smaller): decode (``--batch`` prompts of
   ``--prompt-len`` tokens, ``--decode-len`` new tokens each) and prefill (``--batch`` prompts
   of ``--prefill-len`` tokens, one new token), hlserve's ``LLM.generate`` against transformers
   ``generate`` (one static batch, sdpa), same prompts, side by side.
3. **Roofline**: the median decode step of ``--batch`` sequences at ``--prompt-len`` context,
   timed around the runner with the device synchronised, against the time the bytes it must
   read (every weight once, plus each sequence's K/V) take at ``--bandwidth`` (H200: the
   4.3 TB/s a device copy reaches there).

Prints a table and writes ``--result-file`` (JSON). Record what it printed in docs/bench_results.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # runs from a checkout without installing

from hlserve import LLM, SamplingParams  # noqa: E402
from hlserve.engine.batch import Batch, ScheduledSeq  # noqa: E402
from hlserve.models.tiny import make_tiny_model  # noqa: E402
from hlserve.request import Request  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_greedy(model, prompt: list[int], n: int, device: str) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq], device=device)).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


def check_correctness(root: Path, device: str, quick: bool) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    results = {}
    rng = random.Random(7)
    n_new = 8 if quick else 16
    configs = {"unchunked": {}, "chunk16": {"chunk_size": 16}, "page1": {"page_size": 1,
                                                                        "chunk_size": 50}}
    for arch in (("qwen2",) if quick else ("llama", "qwen2", "qwen3")):
        path = make_tiny_model(root / f"tiny-{arch}", arch=arch, size="tiny", seed=1)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        vocab = hf.config.vocab_size
        shared = [rng.randrange(3, vocab) for _ in range(48)]
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 17, 70, 200)]
        prompts += [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (5, 30)]
        refs = [hf_greedy(hf, p, n_new, device) for p in prompts]
        del hf
        params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
        for name, opts in configs.items():
            llm = LLM(str(path), dtype="float32", device=device, kv_cache_gb=0.25, **opts)
            outs = llm.generate(prompts, params, use_tqdm=False)
            again = llm.generate(prompts, params, use_tqdm=False)  # prefix-cache hits
            same = sum(o.token_ids == r for o, r in zip(outs + again, refs + refs, strict=True))
            results[f"{arch}/{name}"] = f"{same}/{2 * len(prompts)}"
            del llm
    return results


def model_dir(root: Path, size: str) -> Path:
    path = root / f"qwen2-{size}-bf16"
    if not (path / "config.json").exists():
        t = time.perf_counter()
        make_tiny_model(path, arch="qwen2", size=size, dtype="bfloat16")
        print(f"built {path} in {time.perf_counter() - t:.0f} s", flush=True)
    return path


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def time_hlserve(llm: LLM, prompts: list[list[int]], new: int, device: str) -> float:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync(device)
    assert all(len(o.token_ids) == new for o in outs)
    return time.perf_counter() - t


def time_transformers(hf, prompts: list[list[int]], new: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    with torch.inference_mode():
        hf.generate(input_ids=ids[:2, :16], max_new_tokens=2, do_sample=False)
        sync(device)
        t = time.perf_counter()
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                          max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          pad_token_id=0)
        sync(device)
    assert out.shape[1] == ids.shape[1] + new
    return time.perf_counter() - t


def decode_step_ms(llm: LLM, batch: int, context: int, device: str, repeats: int) -> float:
    """One decode step of ``batch`` sequences at ``context`` tokens, over random pages."""
    runner = llm.engine.runner
    ps = runner.page_size
    pages = list(range(runner.num_pages))
    random.Random(0).shuffle(pages)
    seqs = []
    for _ in range(batch):
        req = Request(list(range(3, 3 + context + 1)),
                      SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        req.num_computed = context
        seqs.append(ScheduledSeq(req, context, 1, [pages.pop() for _ in range(-(-(context + 1)
                                                                                  // ps))]))
    step = Batch(seqs)
    runner.execute(step)
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        runner.execute(step)
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def decode_bytes(llm: LLM, batch: int, context: int) -> int:
    """What a decode step must read at least: every weight once, and each sequence's K/V."""
    runner = llm.engine.runner
    weights = sum(t.numel() * t.element_size() for t in runner.model.state_dict().values())
    weights += sum(b.numel() * b.element_size() for b in runner.model.buffers())
    mc = runner.model_config
    kv = batch * (context + 1) * mc.kv_bytes_per_token * 2  # bf16
    return weights + kv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="7b", choices=["tiny", "0.5b", "7b"])
    ap.add_argument("--models", type=Path, default=ROOT / "models")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gb", type=float, default=40.0)
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s (H200 copy)")
    ap.add_argument("--quick", action="store_true", help="one architecture, short runs")
    ap.add_argument("--result-file", type=Path, default=None)
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the CPU path")
        return 2
    t_start = time.perf_counter()
    out: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda")
                 else "cpu", "torch": torch.__version__, "args": {k: str(v) for k, v in
                                                                   vars(args).items()}}
    print(f"== correctness on {out['device']} (fp32, greedy, against transformers)", flush=True)
    out["correctness"] = check_correctness(args.models, args.device, args.quick)
    for k, v in out["correctness"].items():
        print(f"  {k}: {v} identical", flush=True)

    from transformers import AutoModelForCausalLM

    path = model_dir(args.models, args.size)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(args.device).eval()
    vocab = min(hf.config.vocab_size, 4096)
    dec = prompts_of(args.batch, args.prompt_len, vocab, 1)
    pre = prompts_of(args.batch, args.prefill_len, vocab, 2)
    speed = {"transformers": {}, "hlserve": {}}
    print(f"== {path.name}: transformers generate", flush=True)
    t = time_transformers(hf, dec, args.decode_len, args.device)
    speed["transformers"]["decode_output_tok_s"] = args.batch * args.decode_len / t
    t = time_transformers(hf, pre, 1, args.device)
    speed["transformers"]["prefill_tok_s"] = args.batch * args.prefill_len / t
    del hf
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    print(f"== {path.name}: hlserve", flush=True)
    llm = LLM(str(path), dtype="bfloat16", device=args.device, kv_cache_gb=args.kv_cache_gb,
              enable_prefix_caching=False)
    t = time_hlserve(llm, dec, args.decode_len, args.device)
    speed["hlserve"]["decode_output_tok_s"] = args.batch * args.decode_len / t
    t = time_hlserve(llm, pre, 1, args.device)
    speed["hlserve"]["prefill_tok_s"] = args.batch * args.prefill_len / t
    out["throughput"] = speed
    step_ms = decode_step_ms(llm, args.batch, args.prompt_len, args.device,
                             3 if args.quick else 10)
    need = decode_bytes(llm, args.batch, args.prompt_len)
    ideal_ms = need / args.bandwidth * 1e3
    out["roofline"] = {"decode_step_ms": step_ms, "bytes": need, "ideal_ms": ideal_ms,
                       "fraction": ideal_ms / step_ms}
    out["wall_s"] = time.perf_counter() - t_start

    print(f"\n| {path.name} bf16 on {out['device']} | transformers | hlserve | ratio |")
    print("|---|---:|---:|---:|")
    for key, label in (("decode_output_tok_s", f"decode, {args.batch} x {args.prompt_len} in, "
                        f"{args.decode_len} out (output tok/s)"),
                       ("prefill_tok_s", f"prefill, {args.batch} x {args.prefill_len} "
                        "(prompt tok/s)")):
        a, b = speed["transformers"][key], speed["hlserve"][key]
        print(f"| {label} | {a:,.0f} | {b:,.0f} | {b / a:.2f}x |")
    r = out["roofline"]
    print(f"\ndecode step, {args.batch} sequences at {args.prompt_len} context: "
          f"{r['decode_step_ms']:.2f} ms; its {r['bytes'] / 1e9:.2f} GB at "
          f"{args.bandwidth / 1e12:.1f} TB/s take {r['ideal_ms']:.2f} ms: "
          f"{100 * r['fraction']:.0f}% of the bandwidth roofline")
    print(f"total wall time {out['wall_s']:.0f} s")
    if args.result_file:
        args.result_file.parent.mkdir(parents=True, exist_ok=True)
        args.result_file.write_text(json.dumps(out, indent=2) + "\n")
    ok = all(v.split("/")[0] == v.split("/")[1] for v in out["correctness"].values())
    return 0 if ok or args.device.startswith("cuda") else 1


if __name__ == "__main__":
    sys.exit(main())
