"""Small synthetic GGUF files for the loader's tests (written with gguf.GGUFWriter)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

gguf = __import__("pytest").importorskip("gguf")
Q = gguf.GGMLQuantizationType

# a tiny llama: hidden 256 (a K-quant block), 2 layers, 4 heads / 2 KV heads, MLP 256, vocab 300
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 256, 2, 4, 2, 256, 300


def byte_tokens() -> list[str]:
    from hlserve.models.gguf import _byte_alphabet

    return list(_byte_alphabet().values()) + ["<|im_start|>", "<|im_end|>"] + [
        f"tok{i}" for i in range(VOCAB - 258)]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (what the loader undoes)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def quantized_bytes(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Raw blocks of ``kind`` for a (rows, cols) tensor: quantized by gguf where it can, else
    random bytes with every block's fp16 scale fields set to small finite values."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    if kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), kind)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    scale = np.full((raw.shape[0], 1), 0.01, dtype=np.float16).view(np.uint8)
    if kind == Q.Q4_K or kind == Q.Q5_K:  # d, dmin first
        raw[:, 0:2], raw[:, 2:4] = scale, scale
    elif kind == Q.Q6_K:  # d last
        raw[:, -2:] = scale
    return raw.reshape(rows, cols // block * size)


def write_llama(path: Path, *, arch: str = "llama", types: dict[str, Q] | None = None,
                seed: int = 0, extra_tensor: str | None = None,
                add_bos: bool = False) -> dict[str, np.ndarray]:
    """A tiny llama GGUF; returns each tensor as written (fp32 ones in HF order, unpermuted),
    keyed by GGUF name. ``types`` picks a quantized type per GGUF name suffix."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    tokens = byte_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "output.weight": (VOCAB, HIDDEN)}
    hd = HIDDEN // HEADS
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                   f"blk.{i}.attn_q.weight": (HEADS * hd, HIDDEN),
                   f"blk.{i}.attn_k.weight": (KV_HEADS * hd, HIDDEN),
                   f"blk.{i}.attn_v.weight": (KV_HEADS * hd, HIDDEN),
                   f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * hd),
                   f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                   f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)}
    if extra_tensor:
        shapes[extra_tensor] = (HIDDEN,)
    written: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        kind = next((k for suffix, k in (types or {}).items() if name.endswith(suffix)), None)
        if kind is not None and len(shape) == 2:
            raw = quantized_bytes(kind, *shape, rng)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
            written[name] = raw
            continue
        arr = rng.standard_normal(shape).astype(np.float32)
        written[name] = arr
        if arch == "llama" and ".attn_q." in name:
            arr = permute(arr, HEADS)
        elif arch == "llama" and ".attn_k." in name:
            arr = permute(arr, KV_HEADS)
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
