"""The cost model: fits to the public profiles, its shape, its calculator CLI."""

from __future__ import annotations

import json

import pytest

from hlserve.cli.simulate import main as sim_main
from hlserve.sim import fitting
from hlserve.sim.cost import CostModel, IterationShape
from hlserve.sim.hardware import HARDWARE, Hardware, get_hardware, parse_cluster
from hlserve.sim.model_specs import MODELS, resolve_model_spec


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_gemm_fit_reproduces_vidur_profiles(gpu: str) -> None:
    """The fitted efficiency curve reproduces the GEMM profiles it was fitted to: median
    error under 10%, and the constants stored in hardware.py are that fit."""
    gemm, _ = fitting.load_vidur_ops(gpu)
    _, _, peak, bw = fitting.VIDUR_GPUS[gpu]
    fit = fitting.fit_gemm(gemm, peak, bw)
    assert fit.count > 4000
    assert fit.median_err < 0.10
    hw = get_hardware("H100" if gpu == "h100" else "A100")
    stored = fitting.gemm_time_np(gemm.n, gemm.k, gemm.m, peak, bw, hw.gemm_eta_max,
                                  hw.gemm_n_half, hw.gemm_eta_mem, hw.kernel_time)
    err = abs(stored / gemm.time - 1)
    assert float(sorted(err)[len(err) // 2]) < 0.10
    # Vidur's H100/A100 GEMM profiles reach ~80-90% of HBM bandwidth at 1 token and 70-75% of
    # peak FLOP/s at 512+ tokens, so a fitted ceiling lies in this range
    assert 0.65 <= hw.gemm_eta_max <= 0.85


@pytest.mark.parametrize("gpu", ["a100", "h100"])
def test_allreduce_fit(gpu: str) -> None:
    for n, (sizes, times) in fitting.load_vidur_allreduce(gpu).items():
        fit = fitting.fit_allreduce(sizes, times, n)
        assert fit.median_err < 0.10, (gpu, n, fit)
        stored = dict((k, (a, b)) for k, a, b in get_hardware(gpu.upper()).allreduce)[n]
        assert stored[0] == pytest.approx(fit.alpha, rel=0.05)
        assert stored[1] == pytest.approx(fit.algbw, rel=0.05)


def test_known_models_match_published_shapes() -> None:
    """Parameter counts of the built-in shapes match the models' published sizes (their
    model cards), within 1%."""
    expect = {"Qwen2.5-7B": 7.62e9, "Qwen2.5-14B": 14.77e9, "Qwen2.5-32B": 32.76e9,
              "Qwen2.5-72B": 72.71e9, "Llama-3.1-8B": 8.03e9, "Llama-3.1-70B": 70.55e9,
              "Qwen2.5-0.5B": 0.49e9}
    for name, params in expect.items():
        assert MODELS[name].num_parameters() == pytest.approx(params, rel=0.01), name
    # KV per token (bf16): 64 layers x 8 KV heads x 128 head_dim x K and V x 2 bytes = 256 KiB
    assert MODELS["Qwen2.5-32B"].kv_bytes_per_token * 2 == 256 * 1024
    assert resolve_model_spec("qwen/qwen2.5-32b")[0] == "Qwen2.5-32B"


def test_model_from_config_json(tmp_path) -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 512,
           "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
           "num_key_value_heads": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    _, mc = resolve_model_spec(str(path))
    assert mc.hidden_size == 512 and mc.head_dim == 64
    assert resolve_model_spec(str(tmp_path))[1] == mc


def test_hardware_profiles_and_roundtrip(tmp_path) -> None:
    assert set(HARDWARE) == {"H20", "H100", "H200", "A100", "L40S"}
    assert get_hardware("8xH20").name == "H20" and parse_cluster("8xH20") == ("H20", 8)
    assert get_hardware("a100-80gb").name == "A100"
    assert round(get_hardware("H20").ridge) == 37  # 148 TFLOP/s over 4.0 TB/s (NVIDIA's datasheet)
    path = tmp_path / "p.json"
    get_hardware("L40S").save(path)
    back = Hardware.load(path)
    assert back == get_hardware("L40S")
    # all-reduce: profiled sizes reproduce, others extrapolate along the ring
    a8, b8 = get_hardware("H100").allreduce_params(8)
    a16, b16 = get_hardware("H100").allreduce_params(16)
    assert a16 == a8 and b16 < b8


def test_allreduce_alpha_replaces_the_fit_only_where_given(tmp_path) -> None:
    """A measured all-reduce latency (docs/fidelity.md) takes the fit's place at its device
    count only, keeps the fit's bandwidth, shortens a TP decode step by the difference for
    each of its all-reduces (two per layer, one for the logits), and survives a profile's
    save and load; the shipped profiles carry none."""
    hw = get_hardware("A100")
    assert all(h.allreduce_alpha == () for h in HARDWARE.values())
    fixed = hw.replace(allreduce_alpha=((2, 15e-6),))
    assert fixed.allreduce_params(2) == (15e-6, hw.allreduce_params(2)[1])
    assert fixed.allreduce_params(4) == hw.allreduce_params(4)
    model = resolve_model_spec("Llama-3.1-70B")[1]
    slow, fast = CostModel(model, hw, 2).decode(1, 1000), CostModel(model, fixed, 2).decode(1, 1000)
    saved = (2 * model.num_hidden_layers + 1) * (hw.allreduce_params(2)[0] - 15e-6)  # + logits
    assert slow.total - fast.total == pytest.approx(saved, rel=1e-6)
    path = tmp_path / "a100.json"
    fixed.save(path)
    assert Hardware.load(path) == fixed


def _cm(model: str = "Qwen2.5-32B", hw: str = "H20", tp: int = 8) -> CostModel:
    return CostModel(resolve_model_spec(model)[1], get_hardware(hw), tp)


def test_cost_model_shape() -> None:
    cm = _cm()
    # decode is memory bound, a long prefill compute bound
    assert cm.decode(64, 32768).bound == "memory"
    assert cm.prefill(8192).bound == "compute"
    # decode grows with context (KV reads), prefill superlinearly with length (attention)
    assert cm.decode(64, 65536).total > cm.decode(64, 8192).total
    assert cm.prefill(32768).total > 4 * cm.prefill(8192).total
    # chunking never makes a prefill cheaper; smaller chunks cost more
    ref = cm.prefill(16384).total
    assert ref < cm.prefill(16384, 2048).total < cm.prefill(16384, 512).total
    # more GPUs: faster prefill, a pool with more room
    assert _cm(tp=4).prefill(8192).total > cm.prefill(8192).total
    # a mixed iteration costs more than either part alone
    mixed = cm.decode(32, 32768, prefill_tokens=1024).total
    assert mixed > cm.decode(32, 32768).total and mixed > cm.prefill(1024).total
    # KV pool: 8xH20 holds ~2.4M tokens of Qwen2.5-32B (32 KiB per token per GPU)
    assert 2_000_000 < cm.kv_pool_tokens(8192) < 2_700_000
    assert cm.kv_pool_tokens(131072) < cm.kv_pool_tokens(8192)


def test_iteration_matches_components() -> None:
    cm = _cm("Llama-3.1-8B", "H100", 1)
    s = IterationShape(num_tokens=300, num_seqs=5, num_samples=5, prefill=((296, 1000),),
                       num_decodes=4, decode_ctx_sum=8000, decode_ctx_max=3000)
    total, bd = cm.iteration(s, detail=True)
    assert bd is not None and total == pytest.approx(bd.total)
    assert set(bd.parts) >= {"linear", "attention prefill", "attention decode", "host"}
    assert "all-reduce" not in bd.parts  # tp 1


def test_cost_cli(capsys) -> None:
    assert sim_main(["cost", "--hardware", "8xH20", "--model", "Qwen2.5-32B", "--prefill", "8192",
                     "--chunk-size", "512"]) == 0
    text = capsys.readouterr().out
    assert "bound by compute" in text and "chunking costs" in text
    assert sim_main(["cost", "--hardware", "H20", "--tp", "8", "--decode-batch", "64",
                     "--context", "32768", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bound"] == "memory" and out["tp"] == 8 and out["total_ms"] > 0
    assert out["compute_ms"] + out["memory_ms"] + out["communication_ms"] + out["overhead_ms"] == \
        pytest.approx(out["total_ms"])
    assert sim_main(["cost", "--hardware", "nope", "--prefill", "10"]) == 2


def test_a_decode_kernel_that_splits_the_query_group_reads_kv_more_often() -> None:
    """``decode_heads_per_kv_read`` k: a group of g query heads reads its KV head ceil(g / k)
    times in decode attention (TurboMind v0.1's blocks of 4 heads on Llama-70B's groups of 8:
    twice); 0 or k >= g is a grouped kernel (once), and prefill attention does not change."""
    model, hw = MODELS["Llama-3.1-70B"], HARDWARE["A100"]  # 64 query heads, 8 KV heads
    decode = IterationShape(64, 64, 64, (), 64, 64 * 4096, 4096)
    prefill = IterationShape(2048, 1, 1, ((2048, 0),))

    def attn(k: int, shape: IterationShape, part: str) -> float:
        bd = CostModel(model, hw.replace(decode_heads_per_kv_read=k), 4).iteration(shape, True)[1]
        assert bd is not None
        return bd.parts[part]

    once = attn(0, decode, "attention decode")
    assert attn(8, decode, "attention decode") == pytest.approx(once)
    assert attn(4, decode, "attention decode") == pytest.approx(2 * once, rel=0.01)
    assert attn(3, decode, "attention decode") == pytest.approx(3 * once, rel=0.01)
    assert attn(4, prefill, "attention prefill") == attn(0, prefill, "attention prefill")


def test_public_data_ships_with_the_package(monkeypatch, tmp_path) -> None:
    """The Vidur profiles and Mooncake traces come with the package (a fresh clone needs
    nothing beside it), each with its licence; HLSERVE_DATA_DIR still points elsewhere."""
    monkeypatch.delenv("HLSERVE_DATA_DIR", raising=False)
    data = fitting.find_data_dir()
    for gpu, (compute, network, _, _) in fitting.VIDUR_GPUS.items():
        assert (data / "vidur" / compute).is_file() and (data / "vidur" / network).is_file(), gpu
    assert (data / "mooncake_conversation_trace.jsonl").is_file()
    assert "MIT License" in (data / "vidur" / "LICENSE").read_text()
    assert "Apache License" in (data / "LICENSE-Apache-2.0").read_text()
    monkeypatch.setenv("HLSERVE_DATA_DIR", str(tmp_path))
    assert fitting.find_data_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match="HLSERVE_DATA_DIR"):
        fitting.load_vidur_ops("a100")
