"""The bf16 linear kernel (``linear_pairs.cpp``): its output against PyTorch's bf16 linear
across its row groups and column blocks; its gate/up GEMM with SiLU x up in the epilogue
against the unfused ops, to the bit; ``PackedLinear`` taking it up to ``SMALL_ROWS`` rows and
oneDNN past them where the CPU has AMX, and every row count (no oneDNN copy) elsewhere; and
the runner giving every linear its copy unless it is turned off or the copy would not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hlserve import LLM, SamplingParams
from hlserve.models import fused, packed_linear
from hlserve.models.cpu_kernels import gate_up_silu_op, pairs_linear_ops
from hlserve.models.packed_linear import (
    ALL_ROWS,
    SMALL_ROWS,
    PackedLinear,
    can_prepack,
    interleave_gate_up,
)
from support import assert_bf16_linear, load_benchmark

needs_pairs = pytest.mark.skipif(
    pairs_linear_ops() is None or not can_prepack(torch.device("cpu"), torch.bfloat16),
    reason="the decode-size linear kernel needs AVX512_BF16 (and oneDNN's bf16 GEMM)")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@needs_pairs
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 33])
@pytest.mark.parametrize("k,n", [(896, 80), (100, 7), (4864, 898), (896, 1152)])
@pytest.mark.parametrize("bias", [False, True])
def test_pairs_kernel_gives_the_bf16_linear(rows: int, k: int, n: int, bias: bool) -> None:
    """Every row count a batch's last group can have (1-7 rows are a tile of their own size,
    after 8-row groups or alone), N across whole block pairs, an odd last block and a partial
    one (7, 898), K short and long."""
    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    pack, linear = pairs_linear_ops()
    with torch.inference_mode():
        got, want = linear(x, pack(w), n, b), F.linear(x, w, b)
    assert_bf16_linear(got, want, x, w)


def _counting_pairs(calls: list[int]):
    """The kernel's (pack, linear), the linear noting each call's row count in ``calls``."""
    pack, linear = pairs_linear_ops()

    def counting(x, packed, n, bias):
        calls.append(x.shape[0])
        return linear(x, packed, n, bias)
    return pack, counting


@needs_pairs
@pytest.mark.parametrize("rows", [1, 5, 7, 8, 9, 16, 17, 33, 300])
@pytest.mark.parametrize("k,inter", [(896, 4864), (100, 48), (64, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_silu_is_the_unfused_result_to_the_bit(rows: int, k: int, inter: int,
                                                       bias: bool) -> None:
    """The fused epilogue rounds the gate and up sums to bf16 as the GEMM's output does, then
    does silu_mul's arithmetic on them: the same bits as the two ops one after the other."""
    g = torch.Generator().manual_seed(rows * k + inter)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(2 * inter, k, generator=g) * 0.2).to(torch.bfloat16)
    b = torch.randn(2 * inter, generator=g).to(torch.bfloat16) if bias else None
    pack, linear = pairs_linear_ops()
    op = gate_up_silu_op()
    with torch.inference_mode():
        gate_up = linear(x, pack(w), 2 * inter, b)
        want = fused.silu_mul(gate_up[:, :inter], gate_up[:, inter:])
        got = op(x, pack(interleave_gate_up(w)), inter, b)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        op(x, pack(w[: 2 * inter - 16]), inter, None)


@needs_pairs
@pytest.mark.parametrize("max_rows", [SMALL_ROWS, ALL_ROWS])
def test_a_gate_up_layer_fuses_silu_mul_and_still_returns_gate_and_up(max_rows: int) -> None:
    """``PackedLinear(..., gate_up_silu=...)``: ``forward`` is the plain layer's [gate | up]
    (its copy's interleaved blocks put back), ``silu_mul`` is silu_mul over it to the bit, at
    rows the kernel takes and, beside oneDNN, rows it does not; with ``ALL_ROWS`` there is
    no oneDNN copy."""
    lin = torch.nn.Linear(96, 2 * 48, bias=True).to(torch.bfloat16)
    pairs = pairs_linear_ops()
    layer = PackedLinear(lin, pairs=pairs, max_pairs_rows=max_rows, gate_up_silu=gate_up_silu_op())
    plain = PackedLinear(lin, pairs=pairs, max_pairs_rows=max_rows)
    assert layer.fuses_silu_mul and not plain.fuses_silu_mul
    assert (layer.packed_weight is None) == (max_rows == ALL_ROWS)
    with torch.inference_mode():
        for rows in [1, 7, SMALL_ROWS, SMALL_ROWS + 1, 200]:
            x = torch.randn(rows, 96).to(torch.bfloat16)
            gate_up = plain(x)
            assert torch.equal(layer(x), gate_up)
            assert torch.equal(layer.silu_mul(x), fused.silu_mul(gate_up[:, :48], gate_up[:, 48:]))


@needs_pairs
def test_the_kernel_takes_every_row_count_unless_the_cpu_has_amx(monkeypatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert packed_linear.pairs_rows() == SMALL_ROWS
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert packed_linear.pairs_rows() == ALL_ROWS
    lin = torch.nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    calls: list[int] = []
    layer = PackedLinear(lin, pairs=_counting_pairs(calls), max_pairs_rows=ALL_ROWS)
    assert layer.packed_weight is None  # no oneDNN copy: the kernel's replaces it
    with torch.inference_mode():
        for rows in [1, 17, 1500]:
            x = torch.randn(rows, 256).to(torch.bfloat16)
            assert_bf16_linear(layer(x), lin(x), x, lin.weight)
    assert calls == [1, 17, 1500]


@needs_pairs
def test_pairs_kernel_checks_its_arguments() -> None:
    pack, linear = pairs_linear_ops()
    w = torch.randn(40, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="K even"):
        pack(torch.randn(40, 63).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not match"):
        linear(torch.randn(2, 62).to(torch.bfloat16), pack(w), 40, None)
    with pytest.raises(RuntimeError, match="does not match"):
        linear(torch.randn(2, 64).to(torch.bfloat16), pack(w), 60, None)


@needs_pairs
def test_packed_linear_takes_the_kernel_up_to_small_rows_and_onednn_past_them() -> None:
    lin = torch.nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    calls: list[int] = []
    layer = PackedLinear(lin, pairs=_counting_pairs(calls))
    plain = PackedLinear(lin)
    with torch.inference_mode():
        for shape in [(1, 256), (2, 3, 256), (SMALL_ROWS, 256), (SMALL_ROWS + 1, 256)]:
            x = torch.randn(*shape).to(torch.bfloat16)
            got = layer(x)
            assert got.shape == (*shape[:-1], 96)
            assert_bf16_linear(got.reshape(-1, 96), lin(x).reshape(-1, 96),
                               x.reshape(-1, 256), lin.weight)
            if x.numel() // 256 > SMALL_ROWS:  # oneDNN's GEMM: to the bit
                assert torch.equal(got, plain(x))
    assert calls == [1, 6, SMALL_ROWS]


def _pairs_in(llm: LLM) -> list[bool]:
    model = llm.engine.runner.model
    return [m.pairs_op is not None for m in model.modules() if isinstance(m, PackedLinear)]


def _fused_in(llm: LLM) -> list[bool]:
    model = llm.engine.runner.model
    return [m.fuses_silu_mul for name, m in model.named_modules() if name.endswith("gate_up_proj")]


@needs_pairs
def test_the_runner_copies_weights_for_the_kernel_unless_told_not_to(tiny_model_dirs) -> None:
    """Every linear of a bf16 model gets the copy (the tied lm_head too) and each gate/up
    projection fuses SiLU x up; with ``HLSERVE_CPU_SMALL_GEMM=0`` none does (oneDNN). Where
    the copy is a second one beside oneDNN's (an AMX host) and would take over a quarter of
    the available memory, none does; where it replaces oneDNN's, it stays. The greedy tokens
    are the same every way."""
    path = tiny_model_dirs["qwen2"]
    prompts = [[5, 9, 33, 4] * 10, [7] * 3, [11, 12]]
    llm = LLM(str(path), dtype="bfloat16")
    assert _pairs_in(llm) and all(_pairs_in(llm))
    assert _fused_in(llm) and all(_fused_in(llm))
    with_kernel = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HLSERVE_CPU_SMALL_GEMM", "0")
        off = LLM(str(path), dtype="bfloat16")
    assert _pairs_in(off) and not any(_pairs_in(off)) and not any(_fused_in(off))
    assert [o.token_ids for o in off.generate(prompts, GREEDY, use_tqdm=False)] == with_kernel
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed_linear, "_available_bytes", lambda: 1024)
        mp.setattr(packed_linear, "pairs_rows", lambda: SMALL_ROWS)
        tight = LLM(str(path), dtype="bfloat16")
        assert not any(_pairs_in(tight))
        mp.setattr(packed_linear, "pairs_rows", lambda: ALL_ROWS)
        replacing = LLM(str(path), dtype="bfloat16")
        assert all(_pairs_in(replacing))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed_linear, "pairs_rows", lambda: SMALL_ROWS)
        amx_like = LLM(str(path), dtype="bfloat16")
    assert all(_pairs_in(amx_like)) and all(_fused_in(amx_like))
    assert [o.token_ids for o in amx_like.generate(prompts, GREEDY, use_tqdm=False)] == with_kernel


@needs_pairs
def test_decode_linears_benchmark_runs_its_table(capsys, monkeypatch) -> None:
    """benchmarks/decode_linears.py on two layers, one row count, one round: the linears, then
    the MLPs alone (``--mlp``)."""
    bench = load_benchmark("decode_linears")
    monkeypatch.setattr("sys.argv", ["decode_linears.py", "--rows", "4", "--rounds", "1",
                                     "--layers", "2", "--vocab", "1024"])
    bench.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 ")]
    assert len(rows) == 1 and rows[0].count("|") == 5, rows
    monkeypatch.setattr("sys.argv", ["decode_linears.py", "--mlp", "--rows", "4", "--rounds",
                                     "1", "--layers", "2"])
    bench.main()
    out = capsys.readouterr().out
    assert "2 MLPs" in out
    rows = [line for line in out.splitlines() if line.startswith("| 4 ")]
    assert len(rows) == 1 and rows[0].count("|") == 5, rows


@needs_pairs
def test_decode_linears_benchmark_times_another_build(capsys, monkeypatch) -> None:
    """``--against`` compiles the kernels from a directory of sources (here this checkout's
    own) and times that build's kernel in oneDNN's place: the same table, named for it. The
    build is kept under a hash of its sources, so asking for the same sources again loads it
    without compiling."""
    bench = load_benchmark("decode_linears")
    csrc = Path(__file__).resolve().parent.parent / "src" / "hlserve" / "models" / "csrc"
    monkeypatch.setattr("sys.argv", ["decode_linears.py", "--rows", "7", "--rounds", "1",
                                     "--layers", "1", "--vocab", "1024", "--against", str(csrc)])
    bench.main()
    out = capsys.readouterr().out
    assert f"| rows | kernel at {csrc} ms (GB/s) |" in out
    rows = [line for line in out.splitlines() if line.startswith("| 7 ")]
    assert len(rows) == 1 and rows[0].count("|") == 5, rows
    bench.kernels_at(str(csrc))
    assert "building the kernels" not in capsys.readouterr().out
