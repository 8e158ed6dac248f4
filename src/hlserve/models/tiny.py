"""The embedded default model: random weights in Hugging Face format, made locally.

hlserve must run end to end (engine, server, benchmarks, tests) on a machine that cannot reach
a model hub. ``make_tiny_model`` writes a complete Hugging Face model directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, special_tokens_map.json,
generation_config.json) that ``transformers`` loads as it would a real checkpoint, so the same
directory serves as the engine's default model and as the reference for correctness tests.

- Weights are random (normal, std 0.02; RMSNorm weights near 1), drawn from a seeded
  ``torch.Generator``: the same seed gives byte-identical files.
- The tokenizer is a byte-level BPE trained here, with the ``tokenizers`` library
  (:mod:`hlserve.models.tiny_tokenizer`), on a corpus generated here
  (:mod:`hlserve.models.tiny_corpus`: prose, code, JSON, tool calls, shell: agent traffic).
  It does not depend on the seed, and is trained once per process.
- ``size="0.5b"`` has exactly the Qwen2.5-0.5B shape, for memory and speed work at real scale.
  Tensors are generated and written one at a time, so memory stays near the largest tensor.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hlserve.models.tiny_tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    special_tokens_map,
    tokenizer_config,
    trained_tokenizer_json,
)

__all__ = ["ARCHS", "CHAT_TEMPLATE", "DTYPES", "SIZES", "SPECIAL_TOKENS", "TOKENIZER_VOCAB_SIZE",
           "make_tiny_model"]

DTYPES: dict[str, tuple[torch.dtype, str]] = {
    # name -> (torch dtype, safetensors dtype tag)
    "float32": (torch.float32, "F32"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
}

INIT_STD = 0.02
NORM_JITTER = 0.1  # RMSNorm weights are 1 + NORM_JITTER * N(0, 1): not 1, so a skipped norm shows
# Bias std larger than INIT_STD: a q/v projection output has std ~ INIT_STD * sqrt(hidden) (0.3
# for tiny), so a 0.02 bias would barely move it and an engine that drops the bias could pass.
BIAS_STD = 0.1


@dataclass(frozen=True)
class _Arch:
    architecture: str
    model_type: str
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool  # for size "tiny"; "0.5b" is always tied, like Qwen2.5-0.5B
    rope_theta: float  # for size "tiny"; "0.5b" uses Qwen2.5's 1e6
    rms_norm_eps: float


ARCHS: dict[str, _Arch] = {
    "llama": _Arch("LlamaForCausalLM", "llama", False, False, False, 10000.0, 1e-5),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", True, False, True, 1e6, 1e-6),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", False, True, True, 1e6, 1e-6),
}


@dataclass(frozen=True)
class _Shape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None  # None: the trained tokenizer's size
    max_position_embeddings: int
    # Overrides of the architecture's defaults (None: keep the arch's value).
    tie_word_embeddings: bool | None = None
    rope_theta: float | None = None


SIZES: dict[str, _Shape] = {
    # A few million parameters; GQA with 4 query heads per KV head, like the real models.
    "tiny": _Shape(256, 4, 8, 2, 32, 768, None, 32768),
    # Qwen2.5-0.5B exactly. The embedding (151936 rows) is larger than the tokenizer, as in Qwen.
    "0.5b": _Shape(
        896, 24, 14, 2, 64, 4864, 151936, 32768, tie_word_embeddings=True, rope_theta=1e6
    ),
    # Qwen2.5-7B exactly (~15 GB in bf16): for GPU checks (benchmarks/gpu_check.py).
    "7b": _Shape(
        3584, 28, 28, 4, 128, 18944, 152064, 32768, tie_word_embeddings=False, rope_theta=1e6
    ),
}


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a random-weight model in Hugging Face format to ``out_dir`` and return its path.

    ``arch``: "llama", "qwen2" or "qwen3"; ``size``: "tiny" (a few million parameters) or
    "0.5b" (the Qwen2.5-0.5B shape); ``dtype``: "float32", "bfloat16" or "float16". The same
    arguments always produce byte-identical files. Nothing is downloaded.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: choose from {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: choose from {', '.join(SIZES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose from {', '.join(DTYPES)}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json = trained_tokenizer_json()
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    ids = {tok: vocab[tok] for tok in SPECIAL_TOKENS}

    config = _model_config(ARCHS[arch], SIZES[size], len(vocab), ids, dtype)
    # Weights first, through a temporary name, and config.json last: a directory that has a
    # config.json is complete, even if an earlier call was interrupted mid-write.
    tmp = out / "model.safetensors.tmp"
    _write_weights(tmp, _param_specs(config, ARCHS[arch]), seed, dtype)
    tmp.replace(out / "model.safetensors")
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(out / "tokenizer_config.json",
                tokenizer_config(ids, config["max_position_embeddings"]))
    _write_json(out / "special_tokens_map.json", special_tokens_map())
    _write_json(out / "generation_config.json", _generation_config(ids))
    _write_json(out / "config.json", config)
    return out


# ---------------------------------------------------------------------------------------------
# config files


def _model_config(
    arch: _Arch, shape: _Shape, tokenizer_size: int, ids: dict[str, int], dtype: str
) -> dict[str, Any]:
    vocab_size = shape.vocab_size or tokenizer_size
    if vocab_size < tokenizer_size:
        raise ValueError(f"embedding ({vocab_size}) smaller than tokenizer ({tokenizer_size})")
    tie = (
        arch.tie_word_embeddings if shape.tie_word_embeddings is None else shape.tie_word_embeddings
    )
    theta = arch.rope_theta if shape.rope_theta is None else shape.rope_theta
    cfg: dict[str, Any] = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "initializer_range": INIT_STD,
        "rms_norm_eps": arch.rms_norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, older readers (and hlserve's
        # ModelConfig) read the top-level rope_theta.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_dropout": 0.0,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if arch.model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        # Qwen2's config has no attention_bias field (its q/k/v bias is hard-wired), so it is
        # left out there, as in real Qwen2 checkpoints; Qwen3 has the field and it is false.
        if arch.model_type == "qwen3":
            cfg["attention_bias"] = False
        cfg.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=shape.num_hidden_layers,
        )
    return cfg


def _generation_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# weights


@dataclass(frozen=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    init: str  # "normal" (std INIT_STD), "bias" (std BIAS_STD) or "norm" (1 + jitter)


def _param_specs(cfg: dict[str, Any], arch: _Arch) -> list[_Param]:
    """Every tensor of the checkpoint, with Hugging Face names, in a fixed order."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    specs = [_Param("model.embed_tokens.weight", (cfg["vocab_size"], h), "normal")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs.append(_Param(p + "input_layernorm.weight", (h,), "norm"))
        for proj, out_dim in (("q", q), ("k", kv), ("v", kv)):
            specs.append(_Param(f"{p}self_attn.{proj}_proj.weight", (out_dim, h), "normal"))
            if arch.qkv_bias:
                specs.append(_Param(f"{p}self_attn.{proj}_proj.bias", (out_dim,), "bias"))
        if arch.qk_norm:
            specs.append(_Param(p + "self_attn.q_norm.weight", (cfg["head_dim"],), "norm"))
            specs.append(_Param(p + "self_attn.k_norm.weight", (cfg["head_dim"],), "norm"))
        specs.append(_Param(p + "self_attn.o_proj.weight", (h, q), "normal"))
        specs.append(_Param(p + "post_attention_layernorm.weight", (h,), "norm"))
        specs.append(_Param(p + "mlp.gate_proj.weight", (inter, h), "normal"))
        specs.append(_Param(p + "mlp.up_proj.weight", (inter, h), "normal"))
        specs.append(_Param(p + "mlp.down_proj.weight", (h, inter), "normal"))
    specs.append(_Param("model.norm.weight", (h,), "norm"))
    if not cfg["tie_word_embeddings"]:
        specs.append(_Param("lm_head.weight", (cfg["vocab_size"], h), "normal"))
    return specs


def _init_tensor(param: _Param, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    # Always drawn in float32 and then cast, so a bf16 model is the rounded fp32 model of the
    # same seed rather than an unrelated one.
    t = torch.empty(param.shape, dtype=torch.float32)
    if param.init == "norm":
        t.normal_(0.0, NORM_JITTER, generator=gen).add_(1.0)
    else:
        t.normal_(0.0, BIAS_STD if param.init == "bias" else INIT_STD, generator=gen)
    return t.to(dtype)


def _write_weights(path: Path, specs: list[_Param], seed: int, dtype: str) -> None:
    """Write a safetensors file one tensor at a time.

    ``safetensors.torch.save_file`` needs every tensor in memory at once (and older versions
    copy them again): 2-4 GB for the 0.5b model in float32. The format is simple enough
    (8-byte header length, JSON header, raw little-endian data) to stream instead.
    """
    torch_dtype, tag = DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in specs:
        nbytes = itemsize * math.prod(p.shape)
        header[p.name] = {
            "dtype": tag,
            "shape": list(p.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data must start 8-byte aligned

    gen = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for p in specs:
            t = _init_tensor(p, gen, torch_dtype)
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
