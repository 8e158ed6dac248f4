"""Llama / Qwen2 / Qwen3 decoder in pure PyTorch over a paged KV cache.

Parameter names are Hugging Face's, so a checkpoint loads with a plain ``load_state_dict``.
The three families differ only in switches from :class:`ModelConfig`: q/k/v bias (Qwen2),
RMSNorm on q and k per head (Qwen3), tied embeddings. Numerics follow the reference
implementation (norms and RoPE in fp32) so that greedy outputs match it token for token.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hlserve.errors import ModelLoadError
from hlserve.models import fused
from hlserve.models.attention import AttentionMetadata, KeptRows, paged_attention, write_kv
from hlserve.models.model_config import ModelConfig
from hlserve.models.packed_linear import PackedLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        # Llama 3.1: low frequencies scaled by `factor`, high ones kept, smooth in between.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ModelLoadError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos/sin: [T, D] in fp32, cast like the reference does
    return fused.rope(x, cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h, q, kv = cfg.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, q, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, kv, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, kv, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.qkv_proj: nn.Linear | None = None  # set by merge_projections

    def merge_projections(self) -> None:
        """q, k and v as one GEMM (``qkv_proj``), as vLLM's QKVParallelLinear: one pass over
        x and one call instead of three, the same output to the bit (each output column is
        the same dot product; tests/test_attention.py)."""
        self.qkv_proj = _merged([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, d = x.shape[0], self.head_dim
        if self.qkv_proj is None:
            return (self.q_proj(x).view(t, self.num_heads, d),
                    self.k_proj(x).view(t, self.num_kv_heads, d),
                    self.v_proj(x).view(t, self.num_kv_heads, d))
        qkv = self.qkv_proj(x)  # views of its column blocks: rows at qkv's stride
        q_end, k_end = self.num_heads * d, (self.num_heads + self.num_kv_heads) * d
        return (qkv[:, :q_end].view(t, self.num_heads, d),
                qkv[:, q_end:k_end].view(t, self.num_kv_heads, d),
                qkv[:, k_end:].view(t, self.num_kv_heads, d))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kept: KeptRows | None = None,
    ) -> torch.Tensor:
        """Every row's K and V into the cache; the attention output of every row, or of the
        ``kept`` rows only (their queries alone are roped and attend)."""
        q, k, v = self._qkv(x)
        q_cos, q_sin = cos, sin
        if kept is not None:
            q, q_cos, q_sin = q[kept.rows], cos[kept.rows], sin[kept.rows]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q, k = apply_rope(q, q_cos, q_sin), apply_rope(k, cos, sin)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if kept is not None:
            if not kept.row_list:
                return x.new_empty((0, x.shape[1]))
            k, v, meta = k[kept.rows], v[kept.rows], kept.meta
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(q.shape[0], -1))


# On the CPU a merged MLP runs over at most this many rows at a time, so that gate_up's output
# ([rows, 2 x intermediate]) and its activation stay in cache: in one pass, 4,096 rows took
# about as long as separate gate and up GEMMs (0.93-1.05x); in 1,024-row passes they run
# 1.21x faster, 2,048 rows 1.19x faster, and 1,024 or fewer the same (0.5B shape, 2 threads;
# benchmarks/merged_projections.py, docs/bench_results.md). Each row's result is the same to the bit.
# With SiLU x up fused into the gate/up kernel (no [rows, 2 x intermediate] output) the pass
# size no longer matters: 2,048 rows in passes of 512, 1,024 or 2,048 took the same time.
CPU_MLP_ROWS = 1024


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # set by merge_projections

    def merge_projections(self) -> None:
        """gate and up as one GEMM (``gate_up_proj``), as vLLM's MergedColumnParallelLinear."""
        self.gate_up_proj = _merged([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(fused.silu_mul(self.gate_proj(x), self.up_proj(x)))
        rows = x.shape[0]
        if x.device.type != "cpu" or rows <= CPU_MLP_ROWS:
            return self._merged_forward(x)
        return torch.cat([self._merged_forward(x[i : i + CPU_MLP_ROWS])
                          for i in range(0, rows, CPU_MLP_ROWS)])

    def _merged_forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gate_up_proj is not None
        if isinstance(self.gate_up_proj, PackedLinear) and self.gate_up_proj.fuses_silu_mul:
            # SiLU x up in the GEMM's epilogue: no [rows, 2 x inter] output, no pass over it
            return self.down_proj(self.gate_up_proj.silu_mul(x))
        gate_up = self.gate_up_proj(x)
        inter = gate_up.shape[-1] // 2
        return self.down_proj(fused.silu_mul(gate_up[:, :inter], gate_up[:, inter:]))


def _merged(parts: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the parts' outputs side by side (weights stacked by rows).
    Built on the meta device, so no weight is initialised only to be overwritten."""
    first = parts[0]
    merged = nn.Linear(first.in_features, sum(p.out_features for p in parts),
                       bias=first.bias is not None, device="meta")
    merged.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]),
                                 requires_grad=False)
    if first.bias is not None:
        merged.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]),
                                   requires_grad=False)
    return merged


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kept: KeptRows | None = None,
    ) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, kept)
        if kept is not None:  # the rest of the layer on the kept rows only
            x = x[kept.rows]
            if not kept.row_list:
                return x
        norm = self.post_attention_layernorm
        x, h = fused.add_rms_norm(x, a, norm.weight, norm.eps)  # x + a, and its norm
        return x + self.mlp(h)


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole model; ``forward`` returns hidden states (of the ``kept`` rows only, where
    given: the last layer computes no others), ``logits`` projects chosen rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.rotary = RotaryEmbedding(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        kept: KeptRows | None = None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions)
        last = len(self.model.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x = layer(x, cos, sin, kv, meta, kept if i == last else None)
        return self.model.norm(x) if x.shape[0] else x

    def merge_projections(self) -> None:
        """Every layer's q/k/v and gate/up as one GEMM each: after loading, which uses
        Hugging Face's separate names."""
        for layer in self.model.layers:
            layer.self_attn.merge_projections()
            layer.mlp.merge_projections()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
