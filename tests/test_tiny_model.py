"""The embedded default model: transformers must load it as it would a real checkpoint."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from hlserve.models.model_config import ModelConfig
from hlserve.models.tiny import ARCHS, SPECIAL_TOKENS, TOKENIZER_VOCAB_SIZE, make_tiny_model

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402

ARCH_NAMES = sorted(ARCHS)
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
ROUND_TRIP_TEXTS = (
    "Hello, world! The scheduler evicts 42 stale pages.",
    '  def f(x):\n\treturn {"a": [1, 2.5, null]}  \r\n\n',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "Café naïve Straße — “quotes” … €100 ≤ ∞",
    "Привет, мир! 你好，世界！こんにちは 안녕하세요 مرحبا 🚀🤖✅",
    "",
)
QWEN2_5_0_5B_PARAMS = 494_032_768  # Qwen/Qwen2.5-0.5B's published parameter count


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ARCH_NAMES}


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _load(model_dir: Path) -> tuple[torch.nn.Module, dict]:
    return AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_writes_a_complete_model_directory(model_dirs: dict[str, Path], arch: str) -> None:
    d = model_dirs[arch]
    assert sorted(p.name for p in d.iterdir()) == sorted(FILES)
    cfg = _config(d)
    assert cfg["architectures"] == [ARCHS[arch].architecture]
    assert cfg["model_type"] == arch
    assert cfg["vocab_size"] == TOKENIZER_VOCAB_SIZE
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is (arch != "llama")
    assert cfg["rope_theta"] == (10000.0 if arch == "llama" else 1e6)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
    assert ("lm_head.weight" in names) is (arch == "llama")
    assert ("model.layers.0.self_attn.q_proj.bias" in names) is (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) is (arch == "qwen3")


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_transformers_loads_and_runs_it(model_dirs: dict[str, Path], arch: str) -> None:
    d = model_dirs[arch]
    model, info = _load(d)
    assert type(model).__name__ == ARCHS[arch].architecture
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert model.config.rope_parameters["rope_theta"] == _config(d)["rope_theta"]
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied is (arch != "llama")

    # The arch-specific tensors hold values that change the output, not identity defaults.
    attn = model.model.layers[0].self_attn
    if arch == "qwen2":
        assert attn.q_proj.bias.abs().min() > 0
        assert attn.v_proj.bias.abs().mean() > 0.05
    if arch == "qwen3":
        assert not torch.allclose(attn.q_norm.weight, torch.ones_like(attn.q_norm.weight))
        assert not torch.allclose(attn.k_norm.weight, torch.ones_like(attn.k_norm.weight))

    ids = torch.tensor([[5, 17, 300, 1200, 4000]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5, TOKENIZER_VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # random weights, but not a degenerate (constant) output

    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 9)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_model_config_matches_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    d = model_dirs[arch]
    mc = ModelConfig.from_dir(d)
    assert mc.architecture == ARCHS[arch].architecture
    assert mc.attention_bias is (arch == "qwen2")
    assert mc.qk_norm is (arch == "qwen3")
    assert mc.tie_word_embeddings is (arch != "llama")
    assert (mc.hidden_size, mc.num_hidden_layers, mc.head_dim) == (256, 4, 32)
    assert (mc.num_attention_heads, mc.num_key_value_heads) == (8, 2)
    assert mc.vocab_size == TOKENIZER_VOCAB_SIZE
    assert mc.rope_theta == (10000.0 if arch == "llama" else 1e6)
    assert mc.torch_dtype == "float32"

    model, _ = _load(d)
    assert mc.num_parameters() == sum(p.numel() for p in model.parameters())
    assert mc.num_parameters() == sum(t.numel() for t in _tensors(d / "model.safetensors").values())


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_special_token_ids_agree_everywhere(model_dirs: dict[str, Path], arch: str) -> None:
    d = model_dirs[arch]
    tok = AutoTokenizer.from_pretrained(d)
    endoftext, im_start, im_end = (tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS)
    assert len({endoftext, im_start, im_end}) == 3
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == endoftext

    mc = ModelConfig.from_dir(d)
    assert mc.eos_token_ids == (im_end,)
    assert mc.bos_token_id == endoftext
    gen = GenerationConfig.from_pretrained(d)
    assert (gen.eos_token_id, gen.bos_token_id, gen.pad_token_id) == (im_end, endoftext, endoftext)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_tokenizer_round_trips_and_matches_tokenizers(
    model_dirs: dict[str, Path], arch: str
) -> None:
    d = model_dirs[arch]
    tok = AutoTokenizer.from_pretrained(d)
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert len(tok) == raw.get_vocab_size() == TOKENIZER_VOCAB_SIZE
    for text in ROUND_TRIP_TEXTS:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
        # The engine tokenizes with the `tokenizers` library: it must agree with transformers,
        # including for qwen2, where transformers 5 rebuilds the pipeline itself.
        assert raw.encode(text).ids == ids
        assert raw.decode(ids) == text
    # A trained, not a byte-only, tokenizer: common text compresses well below a byte per token.
    english = ROUND_TRIP_TEXTS[0] * 4
    assert len(tok(english)["input_ids"]) < len(english) / 3
    # Special tokens in text are single tokens; no BOS/EOS is added implicitly.
    assert tok("<|im_start|>user<|im_end|>")["input_ids"][0] == tok.convert_tokens_to_ids(
        "<|im_start|>"
    )
    assert len(tok("<|im_end|>")["input_ids"]) == 1


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_chat_template_is_chatml(model_dirs: dict[str, Path], arch: str) -> None:
    tok = AutoTokenizer.from_pretrained(model_dirs[arch])
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\nSunny.<|im_end|>\n"
        "<|im_start|>user\nAnd tomorrow?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")

    # transformers 5 returns a BatchEncoding here; 4.x returned a plain list.
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    assert ids == tok(text)["input_ids"]
    assert tok.decode(ids) == text


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", arch="qwen2", seed=7)
    b = make_tiny_model(tmp_path / "b", arch="qwen2", seed=7)
    c = make_tiny_model(tmp_path / "c", arch="qwen2", seed=8)
    for name in FILES:
        assert _sha(a / name) == _sha(b / name), name
    assert _sha(a / "model.safetensors") != _sha(c / "model.safetensors")
    assert _sha(a / "tokenizer.json") == _sha(c / "tokenizer.json")  # seed-independent
    ta, tc = _tensors(a / "model.safetensors"), _tensors(c / "model.safetensors")
    assert ta.keys() == tc.keys()
    for name in ta:
        assert not torch.equal(ta[name], tc[name]), name
    # Re-making into an existing directory overwrites it to the same bytes.
    make_tiny_model(a, arch="qwen2", seed=7)
    assert _sha(a / "model.safetensors") == _sha(b / "model.safetensors")


def test_tokenizer_training_is_deterministic_across_processes(model_dirs: dict[str, Path]) -> None:
    # Rust hash maps are seeded per process; the trained merges must not depend on that.
    code = (
        "import hashlib, sys; from hlserve.models.tiny_tokenizer import trained_tokenizer_json as t; "
        "sys.stdout.write(hashlib.sha256(t().encode()).hexdigest())"
    )
    here = _sha(model_dirs["llama"] / "tokenizer.json")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout == here


def test_bfloat16_is_the_rounded_float32_model(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    d = make_tiny_model(tmp_path / "bf16", arch="llama", dtype="bfloat16")
    assert _config(d)["torch_dtype"] == _config(d)["dtype"] == "bfloat16"
    assert ModelConfig.from_dir(d).torch_dtype == "bfloat16"
    t16, t32 = (
        _tensors(d / "model.safetensors"),
        _tensors(model_dirs["llama"] / "model.safetensors"),
    )
    for name, t in t16.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, t32[name].to(torch.bfloat16)), name
    model, info = _load(d)
    assert model.dtype == torch.bfloat16 and not info["missing_keys"]


@pytest.mark.parametrize(
    "kwargs", [{"arch": "gpt2"}, {"size": "13b"}, {"dtype": "int8"}], ids=["arch", "size", "dtype"]
)
def test_rejects_unknown_choices(tmp_path: Path, kwargs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="unknown"):
        make_tiny_model(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_half_billion_has_the_qwen2_5_0_5b_shape(tmp_path: Path) -> None:
    # Built in a child process so that its peak memory can be measured on its own.
    d = tmp_path / "q05"
    code = (
        "import sys; from hlserve.models.tiny import make_tiny_model; "
        "make_tiny_model(sys.argv[1], arch='qwen2', size='0.5b', dtype='bfloat16'); "
        "print([line for line in open('/proc/self/status') if line.startswith('VmHWM')][0])"
    )
    out = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    # The child's own peak: VmHWM belongs to the address space exec created. (ru_maxrss does
    # not: Linux keeps it across fork and exec, so it reported the pytest parent's RSS, up
    # to 4.9 GiB late in a session, not this build's.)
    peak_gib = int(out.stdout.split()[-2]) / 2**20  # "VmHWM:  N kB"
    # Tensors are streamed to disk one at a time: about 1 GiB for 0.5B bf16 weights; holding
    # them all in fp32 at once would pass 2 GiB.
    assert peak_gib < 2.0, f"building the 0.5b model peaked at {peak_gib:.2f} GiB"

    cfg = _config(d)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (
        24,
        896,
        4864,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (14, 2, 64)
    assert cfg["vocab_size"] == 151936 > TOKENIZER_VOCAB_SIZE
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 1e6 and cfg["max_position_embeddings"] == 32768

    mc = ModelConfig.from_dir(d)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        n_file = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in names)
    assert "lm_head.weight" not in names
    assert n_file == mc.num_parameters() == QWEN2_5_0_5B_PARAMS

    # One token through transformers: the checkpoint loads at full size and runs.
    model, info = _load(d)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        logits = model(torch.tensor([[11]])).logits
    assert logits.shape == (1, 1, 151936)
    assert torch.isfinite(logits).all()
