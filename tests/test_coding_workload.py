"""The coding-pipeline workload (hlserve.driver.coding_workload, issue 24): a shared synthetic
repository, deterministic from its seed; each round's prompt quotes files of it and asks for
an edited file; sessions quoting the same file share the prompt's prefix through the real
chat template; the real model (SmolLM2-135M-Instruct) answers in the closed loop, and
``hlserve bench --workload coding`` runs against a real server."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from hlserve.bench.serve_bench import BenchSpec, run_bench
from hlserve.driver.closed_loop import Loop, run_closed_loop
from hlserve.driver.coding_workload import CodingWorkload, Repository
from hlserve.errors import ModelLoadError
from hlserve.models.resolve import resolve_model
from hlserve.server.runtime.launch import ServerProcess
from hlserve.tokenizer import Tokenizer

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def smol_dir() -> str:
    try:
        return resolve_model(MODEL, quiet=True)
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def tok(smol_dir: str) -> Tokenizer:
    t = Tokenizer.from_dir(smol_dir)
    assert t is not None
    return t


def has_word(text: str, word: str) -> bool:
    return re.search(rf"\b{word}\b", text) is not None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_repository_is_deterministic_python_and_each_edit_applies() -> None:
    a, b = CodingWorkload(seed=3, files=6), CodingWorkload(seed=3, files=6)
    assert a.repo.system_prompt() == b.repo.system_prompt()
    tasks = [a.task(s, r) for s in range(12) for r in range(3)]
    assert tasks == [b.task(s, r) for s in range(12) for r in range(3)]
    assert Repository(6, seed=4).sources != a.repo.sources
    assert len({f.path for f in a.repo.sources}) == 6
    for f in (*a.repo.sources, a.repo.common):
        ast.parse(f.text)
        assert len(f.functions) >= 2 and all(fn.text in f.text for fn in f.functions)
    for t in tasks:
        edited = ast.parse(t.expected)  # the edit leaves valid Python
        assert t.expected != t.files[-1].text
        # the new name is in the edited file, the old one gone (a parameter: from its
        # function; another function may have one of the same name)
        assert f"`{t.old}`" in t.instruction and f"`{t.new}`" in t.instruction
        assert has_word(t.expected, t.new) and not has_word(t.files[-1].text, t.new)
        assert has_word(t.files[-1].text, t.old)
        if "parameter" not in t.instruction:
            assert not has_word(t.expected, t.old)
        assert isinstance(edited, ast.Module)
    kinds = {t.instruction.split()[2] for t in tasks}
    assert kinds == {"function", "parameter", "constant"}


def test_prompts_quote_files_of_the_shared_repository() -> None:
    w = CodingWorkload(sessions=16, rounds=3, files=4, files_per_round=2)
    quoted: dict[str, set[int]] = {}
    for s in range(w.sessions):
        for r in range(w.rounds):
            t = w.task(s, r)
            assert len(t.files) == 2 and t.files[0] != t.files[1]
            for f in t.files:
                assert f in w.repo.sources  # the shared original, not a session's copy
                assert f"File `{f.path}`:\n```python\n{f.text}```" in t.prompt
                quoted.setdefault(f.path, set()).add(s)
            # the file comes first, the instruction after it, naming the file edited
            assert t.prompt.index(t.instruction) > t.prompt.index(t.files[-1].text)
            assert t.prompt.endswith(f"`{t.files[-1].path}` in one code block.")
        assert w.task(s, 0).files[-1] == w.repo.sources[s % w.files]
    assert all(len(sessions) >= 4 for sessions in quoted.values())  # files are shared


def test_sessions_share_prefixes_and_carry_the_reply(tok: Tokenizer) -> None:
    w = CodingWorkload(sessions=8, rounds=2, files=4)
    ss = w.sessions_list(tok)
    prompts = [s.next_request()[0] for s in ss]
    system = tok.encode_chat(ss[0].messages[:1], add_generation_prompt=False)
    file0 = len(tok.encode(w.repo.sources[0].text, add_special_tokens=False))
    # every session shares the system prompt (the repository's listing and common.py) ...
    assert all(common_prefix(prompts[0], p) >= len(system) - 2 for p in prompts[1:])
    # ... and sessions on the same first file share that file too
    assert common_prefix(prompts[0], prompts[4]) >= len(system) + file0
    assert common_prefix(prompts[0], prompts[1]) < len(system) + 10
    assert not ss[0].ignore_eos and ss[0].next_request is not None
    reply = "```python\nx = 1\n```"
    ss[0].complete(tok.encode(reply, add_special_tokens=False))
    nxt, max_tokens = ss[0].next_request()
    assert max_tokens == w.max_tokens and ss[0].replies == [reply]
    # the next round extends the conversation: the earlier prompt and the reply come first
    assert common_prefix(prompts[0], nxt) >= len(prompts[0]) - 1
    assert reply in tok.decode(nxt) and ss[0].messages[-2]["content"] == reply
    ss[0].complete([])
    assert ss[0].done


def test_the_real_model_edits_in_the_closed_loop(smol_dir: str) -> None:
    from hlserve.llm import LLM

    engine = LLM(smol_dir, mode="throughput", num_pages=256).engine
    w = CodingWorkload(sessions=2, rounds=2, files=1, max_tokens=12)
    ss = w.sessions_list(engine.tokenizer)
    res = run_closed_loop(engine, ss.__getitem__, 2, Loop())
    assert res.errors == 0 and len(res.records) == 4
    by_id = {r.request_id: r for r in res.records}
    # one file: both sessions' first rounds share system + file; the second finds it cached
    system_and_file = len(engine.tokenizer.encode(
        w.repo.system_prompt() + w.repo.sources[0].text, add_special_tokens=False))
    assert by_id["s1-r0"].cached_tokens >= system_and_file - 2 * engine.kv.page_size
    for s in ss:
        assert len(s.replies) == 2 and all(s.replies)
        # the model's own reply, decoded, is in the conversation its next round sent
        assert s.messages[2] == {"role": "assistant", "content": s.replies[0]}
    assert by_id["s0-r1"].cached_tokens > by_id["s0-r0"].prompt_tokens - engine.kv.page_size
    assert engine.kv.num_used == 0


def test_hlserve_bench_runs_the_coding_workload(tiny_llama: Path, tmp_path: Path) -> None:
    args = ["--dtype", "float32", "--max-model-len", "4096", "--num-pages", "512",
            "--uvicorn-log-level", "warning"]
    with ServerProcess(tiny_llama, args, log_path=tmp_path / "server.log") as srv:
        spec = BenchSpec(base_url=srv.url, workload="coding", sessions=3, rounds=2,
                         repo_files=2, output_len=(6, 6), tokenizer=str(tiny_llama),
                         progress=False, result_file=str(tmp_path / "res.json"), timeout=120)
        res = run_bench(spec)
    assert res["completed"] == 6 and res["failed"] == 0, res.get("errors")
    assert res["coding_workload"]["files"] == 2
    rows = [json.loads(line) for line in Path(res["request_file"]).read_text().splitlines()]
    assert {(r["session_id"], r["round"]) for r in rows} == {(s, r) for s in range(3)
                                                             for r in range(2)}
    # every session shares the system prompt (sessions 0 and 2 their first file too): the
    # server found it cached
    assert res["total_cached_tokens"] > 0
    assert all(r["output_tokens"] <= 6 for r in rows)
