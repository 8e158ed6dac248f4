"""``hlserve`` command line: tiny-model, generate, demo, serve, report, and the parser that adds
bench, sweep (``measure``), cost, calibrate and study (``simulate``)."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hlserve.engine.args import add_engine_args, engine_options, make_config
from hlserve.errors import run_command
from hlserve.models.default_model import default_model

if TYPE_CHECKING:
    from hlserve.llm import LLM


def cmd_tiny_model(args: argparse.Namespace) -> None:
    from hlserve.models.tiny import make_tiny_model

    t0 = time.perf_counter()
    out = make_tiny_model(args.out_dir, arch=args.arch, size=args.size, seed=args.seed,
                          dtype=args.dtype)
    print(f"wrote a random {args.arch} model ({args.size}, {args.dtype}) to {out} "
          f"in {time.perf_counter() - t0:.1f}s")


def cmd_generate(args: argparse.Namespace) -> None:
    from hlserve.llm import LLM
    from hlserve.models.resolve import is_instruct, resolve_model
    from hlserve.request import SamplingParams

    llm = LLM.from_config(make_config(resolve_model(args.model), **engine_options(args)),
                          instruct=is_instruct(args.model))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    for prompt in args.prompt:
        out = llm.generate([_generate_prompt(llm, prompt, args.chat)], params, use_tqdm=False)[0]
        print(f"--- prompt: {prompt!r}\n{out.text}\n--- {len(out.token_ids)} tokens, "
              f"finish_reason={out.finish_reason}")


def _generate_prompt(llm: LLM, prompt: str, chat: str) -> str | list[int]:
    """The prompt as text, or as one user turn rendered by the chat template: ``auto`` renders
    it for an instruct model (a .gguf file or a named one, whose metadata carries its chat
    template), as llama.cpp's CLI does; the random tiny model's text stays raw."""
    tok = llm.tokenizer
    has_template = tok is not None and tok.chat_template is not None
    if chat == "on" and not has_template:
        raise ValueError("--chat on: the model has no chat template")
    if chat == "off" or tok is None or not has_template or (chat == "auto" and not llm.instruct):
        return prompt
    return tok.encode_chat([{"role": "user", "content": prompt}])


def cmd_demo(args: argparse.Namespace) -> None:
    """The human tax on the default model: SLO mode against throughput mode, interleaved
    repeats with intervals, then the simulated 32K case where the tax exists (bench/demo.py)."""
    from hlserve.bench.demo import DemoSpec, run_demo

    if args.agent:
        from hlserve.bench.agent_demo import AgentSpec, run_agent_demo

        run_agent_demo(AgentSpec(model=args.model or "smollm2-135m", sessions=args.agent_sessions,
                                 repeats=args.agent_repeats, seed=args.workload_seed))
        return
    common = engine_options(args)
    common.pop("mode", None)
    spec = DemoSpec(model=args.model or str(default_model()), sessions=args.sessions,
                    rounds=args.rounds, system_prompt_len=args.system_prompt_len,
                    repeats=args.repeats, seed=args.workload_seed, sim=args.sim,
                    sim_repeats=args.sim_repeats)
    run_demo(spec, common)


def cmd_serve(args: argparse.Namespace) -> None:
    """The OpenAI-compatible HTTP server (docs/server.md)."""
    from hlserve.cpu_runtime import arrange

    arrange(getattr(args, "device", "auto"))  # may re-execute this command once, first
    from hlserve.models.resolve import resolve_model
    from hlserve.server.app import serve
    from hlserve.server.runtime.settings import DEFAULT_MAX_STEP_SECONDS, server_settings

    # the one EngineConfig: the flags given (typed by argparse) over the preset's knobs, for
    # this machine; a server keeps the step-time safety cap unless told otherwise (no request
    # holds it). serve() hands it to the one engine factory, which hands it to the scheduler.
    options = {"max_step_seconds": DEFAULT_MAX_STEP_SECONDS, **engine_options(args)}
    serve(make_config(resolve_model(args.model), **options), server_settings(args, args.model))


def cmd_report(args: argparse.Namespace) -> None:
    """The HTML report of a result already on disk (hlserve.html_report)."""
    from hlserve.html_report import write_report

    src = Path(args.result)
    out = args.output or (src / "report.html" if src.is_dir() else src.with_suffix(".html"))
    print(f"wrote {write_report(src, out)}")


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    """``hlserve report RESULT [-o FILE.html]``."""
    p = sub.add_parser("report", help="an HTML report of a sweep, study or bench result "
                                      "(docs/bench.md)")
    p.add_argument("result", help="a sweep's or a study's folder (--out), a sweep.json, or a "
                                  "bench result JSON (--result-file)")
    p.add_argument("-o", "--output", default=None, metavar="FILE.html",
                   help="where to write it (default: RESULT/report.html for a folder, "
                        "RESULT.html beside a JSON file)")
    p.set_defaults(func=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hlserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tiny-model", help="write a random-weight model in Hugging Face format")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--arch", default="qwen2", choices=["llama", "qwen2", "qwen3"])
    p.add_argument("--size", default="tiny", choices=["tiny", "0.5b"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=cmd_tiny_model)

    p = sub.add_parser("generate", help="generate from a model, for a quick look")
    p.add_argument("model", help="model directory, .gguf file, or smollm2-135m")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--chat", choices=["auto", "on", "off"], default="auto",
                   help="render each prompt as a user turn with the chat template (auto: for "
                        "a .gguf file or a named model such as smollm2-135m)")
    add_engine_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the human tax on the embedded default model: SLO vs throughput mode")
    p.add_argument("--model", default=None, help="model directory (default: embedded model)")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=1024)
    from hlserve.driver.repeats import add_repeat_args

    add_repeat_args(p, default=8)
    p.add_argument("--workload-seed", type=int, default=0,
                   help="workload seed of repeat 0 (repeat i: this + i) (default: 0)")
    p.add_argument("--sim-repeats", type=int, default=3,
                   help="seeds of the simulated 32K case (default: 3)")
    p.add_argument("--no-sim", dest="sim", action="store_false",
                   help="skip the simulated 32K case")
    p.add_argument("--agent", action="store_true",
                   help="instead: tool-calling agent sessions on the real model (smollm2-135m) "
                        "through the openai SDK against hlserve serve, SLO vs throughput mode")
    p.add_argument("--agent-sessions", type=int, default=4,
                   help="--agent: concurrent sessions a run (default: 4)")
    p.add_argument("--agent-repeats", type=int, default=3,
                   help="--agent: repeats a mode, interleaved (default: 3)")
    add_engine_args(p)
    p.set_defaults(func=cmd_demo)

    from hlserve.server.runtime.settings import add_server_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (docs/server.md)")
    p.add_argument("model", help="model directory, .gguf file, or smollm2-135m")
    add_server_args(p)
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    from hlserve.cli.measure import add_bench_args, add_sweep_args, cmd_bench, cmd_sweep

    p = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (docs/bench.md)")
    add_bench_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("sweep", help="SLO knob sweep: frontier and human tax (docs/bench.md)")
    add_sweep_args(p)
    p.set_defaults(func=cmd_sweep)

    add_report_parser(sub)

    from hlserve.cli.simulate import add_subcommands

    add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_command(args)
