"""GGUF checkpoints (llama.cpp's format): converted once into a Hugging Face model directory.

A ``.gguf`` file is read with the ``gguf`` package; its weights are dequantized to fp32 (the
model runs bf16/fp32: quantized kernels are out of scope), llama.cpp's row permutation of the
Llama q/k projections is undone, the config comes from the ``<arch>.*`` metadata and the
tokenizer (vocabulary, merges, special tokens, chat template) from the ``tokenizer.*`` metadata,
as transformers builds them. The result is written as ``config.json`` + ``model.safetensors`` +
``tokenizer.json`` + ``tokenizer_config.json`` into a cache directory keyed by the file's
content hash, so a second start loads safetensors directly and vLLM can load the same directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hlserve.errors import ModelLoadError

CONVERTER_VERSION = 1  # part of the cache key: a change to the conversion invalidates copies

# general.architecture -> (config.json architecture, q/k rows permuted by llama.cpp's converter)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

# the tensor types dequantized at load (gguf.quants implements each)
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor name (after ``blk.N.``) -> Hugging Face name (after ``model.layers.N.``)
LAYER_TENSORS: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ModelLoadError("loading a .gguf file needs the gguf package: pip install gguf") from None
    return gguf


@dataclass
class GGUFFile:
    """The parsed file: metadata as Python values and the reader (tensors are memory-mapped)."""

    path: Path
    meta: dict[str, Any]
    reader: Any

    @classmethod
    def open(cls, path: Path) -> GGUFFile:
        gguf = _gguf()
        try:
            reader = gguf.GGUFReader(str(path))
        except Exception as e:  # the reader raises ValueError, struct.error, ... on a bad file
            raise ModelLoadError(f"{path.name} is not a readable GGUF file: {e}") from None
        meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        return cls(path, meta, reader)

    def arch(self) -> str:
        arch = self.meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path.name}: unsupported GGUF architecture {arch!r}: hlserve loads "
                f"{', '.join(GGUF_ARCHITECTURES)}")
        return str(arch)

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch()}.{key}", default)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path.name}: GGUF metadata lacks {self.arch()}.{key}")
        return value


def gguf_config(f: GGUFFile) -> dict[str, Any]:
    """config.json for the file, from its metadata (transformers' GGUF config mapping)."""
    arch = f.arch()
    heads = int(f.need("attention.head_count"))
    hidden = int(f.need("embedding_length"))
    names = {t.name for t in f.reader.tensors}
    tokens = f.meta.get("tokenizer.ggml.tokens") or []
    scaling = f.get("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"{f.path.name}: RoPE scaling {scaling!r} is not supported")
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch][0]],
        "model_type": arch,
        "vocab_size": int(f.get("vocab_size") or len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": int(f.need("feed_forward_length")),
        "num_hidden_layers": int(f.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.get("attention.head_count_kv") or heads),
        "head_dim": int(f.get("attention.key_length") or hidden // heads),
        "max_position_embeddings": int(f.get("context_length") or 2048),
        "rms_norm_eps": float(f.get("attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": float(f.get("rope.freq_base") or 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    for key, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
        value = f.meta.get(f"tokenizer.ggml.{meta_key}")
        if value is not None:
            cfg[key] = int(value)
    return cfg


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one hlserve does not know."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
    return None


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: its converter interleaves each head's two rotary halves
    (rows ``[0, d/2)`` and ``[d/2, d)``) for its own RoPE kernel; the HF model expects halves."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def dequantize(f: GGUFFile, tensor: Any) -> np.ndarray:
    """One tensor as fp32, in the (rows, columns) order of PyTorch (GGUF lists dims reversed)."""
    gguf = _gguf()
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"{f.path.name}: tensor {tensor.name} has type {kind}, which hlserve does not "
            f"dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
    shape = tuple(int(d) for d in reversed(tensor.shape))
    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.array(data, dtype=np.float32).reshape(shape)  # a copy: the file is mmapped


def gguf_tensors(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every weight under its Hugging Face name, dequantized, q/k un-permuted for Llama."""
    permuted = GGUF_ARCHITECTURES[f.arch()][1]
    out: dict[str, np.ndarray] = {}
    for tensor in f.reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            if tensor.name == "rope_freqs.weight":
                raise ModelLoadError(f"{f.path.name}: per-dimension RoPE factors (rope_freqs) "
                                     "are not supported")
            raise ModelLoadError(f"{f.path.name}: unknown tensor {tensor.name!r} for "
                                 f"{f.arch()}")
        w = dequantize(f, tensor)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = reverse_permute(w, cfg["num_attention_heads"])
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = reverse_permute(w, cfg["num_key_value_heads"])
        out[name] = w
    return out


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies spell in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def gguf_tokenizer(f: GGUFFile) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json) from the metadata: byte-level BPE with the
    file's vocabulary and merges, its control tokens special, as transformers builds it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = f.meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{f.path.name}: tokenizer model {kind!r} is not supported "
                             "(hlserve builds byte-level BPE, tokenizer.ggml.model 'gpt2')")
    tokens: list[str] = list(f.meta["tokenizer.ggml.tokens"])
    types = list(f.meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in f.meta.get("tokenizer.ggml.merges") or []]
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    bos_id = f.meta.get("tokenizer.ggml.bos_token_id")
    if f.meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        # Llama 3 style files: BOS in front of every encode, as llama.cpp and transformers do
        bos = tokens[int(bos_id)]
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, int(bos_id))])])
    # 3 = CONTROL (special), 4 = USER_DEFINED (added, not special); a control token spelled
    # outside the byte alphabet is a llama.cpp mislabel, skipped as transformers does
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types, strict=True)
                            if k == 3 and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types, strict=True) if k == 4 and t in vocab])
    return tok.to_str(), _tokenizer_config(f, tokens)


def _tokenizer_config(f: GGUFFile, tokens: list[str]) -> dict[str, Any]:
    def token(key: str) -> str | None:
        i = f.meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    cfg: dict[str, Any] = {
        "bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
        "add_bos_token": bool(f.meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(f.meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(f.get("context_length") or 2048),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = f.meta.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = str(template)
    return cfg


def cache_root() -> Path:
    from hlserve.models.default_model import DEFAULT_MODEL_HOME

    return DEFAULT_MODEL_HOME / "gguf"


def file_digest(path: Path) -> str:
    h = hashlib.sha256(f"v{CONVERTER_VERSION}".encode())
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:20]


def convert_gguf(path: str | Path, root: Path | None = None, quiet: bool = False) -> Path:
    """The converted model directory of a ``.gguf`` file, written on first use."""
    src = Path(path)
    if not src.is_file():
        raise ModelLoadError(f"GGUF file {str(src)!r} does not exist")
    out = (root or cache_root()) / f"{src.stem}-{file_digest(src)}"
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    if not quiet:
        print(f"converting {src.name} to a safetensors directory at {out} ...", flush=True)
    _write_converted(GGUFFile.open(src), out)
    return out


def _write_converted(f: GGUFFile, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = gguf_config(f)
    tok_json, tok_cfg = gguf_tokenizer(f)  # before the weights: a bad tokenizer fails fast
    tensors = {k: torch.from_numpy(v) for k, v in gguf_tensors(f, cfg).items()}
    if cfg["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    # written beside the target and renamed: a crash mid-way leaves no half directory that a
    # later start would take for a finished one
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "tokenizer.json").write_text(tok_json)
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():
            raise
