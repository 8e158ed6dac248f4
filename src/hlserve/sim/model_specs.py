"""Model shapes the simulator knows by name, or any Hugging Face ``config.json``.

Shapes are the published ``config.json`` values of each model on its hub page; only what the cost model
and the KV accounting need is used: layers, hidden size, heads, KV heads, head dim,
intermediate size, vocabulary. ``max_position_embeddings`` is the longest context the model
is served at: Qwen2.5 7B and up are served at 128K with YaRN rope scaling (their model cards),
which the long-context study needs; 0.5B stays at 32K.
"""

from __future__ import annotations

import json
from pathlib import Path

from hlserve.errors import ModelLoadError
from hlserve.models.model_config import ModelConfig


def _shape(arch: str, layers: int, hidden: int, heads: int, kv_heads: int, inter: int, vocab: int,
           max_len: int, head_dim: int = 128, tied: bool = False,
           eos: tuple[int, ...] = ()) -> ModelConfig:
    bias = arch == "Qwen2ForCausalLM"
    return ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max_len, tie_word_embeddings=tied,
        attention_bias=bias, eos_token_ids=eos, torch_dtype="bfloat16",
    )


_QWEN_EOS = (151643, 151645)
_LLAMA_EOS = (128001, 128008, 128009)
_Q, _L = "Qwen2ForCausalLM", "LlamaForCausalLM"

MODELS: dict[str, ModelConfig] = {
    # the models' published config.json files
    "Qwen2.5-0.5B": _shape(_Q, 24, 896, 14, 2, 4864, 151936, 32768, head_dim=64, tied=True,
                           eos=_QWEN_EOS),
    "Qwen2.5-7B": _shape(_Q, 28, 3584, 28, 4, 18944, 152064, 131072, eos=_QWEN_EOS),
    "Qwen2.5-14B": _shape(_Q, 48, 5120, 40, 8, 13824, 152064, 131072, eos=_QWEN_EOS),
    "Qwen2.5-32B": _shape(_Q, 64, 5120, 40, 8, 27648, 152064, 131072, eos=_QWEN_EOS),
    "Qwen2.5-72B": _shape(_Q, 80, 8192, 64, 8, 29568, 152064, 131072, eos=_QWEN_EOS),
    "Llama-3.1-8B": _shape(_L, 32, 4096, 32, 8, 14336, 128256, 131072, eos=_LLAMA_EOS),
    "Llama-3.1-70B": _shape(_L, 80, 8192, 64, 8, 28672, 128256, 131072, eos=_LLAMA_EOS),
    # Also: the 34B-class model of Sarathi-Serve's chunked-prefill measurements
    # (01-ai/Yi-34B config.json: 60 layers, hidden 7168, 56/8 heads, intermediate 20480).
    "Yi-34B": _shape(_L, 60, 7168, 56, 8, 20480, 64000, 32768, eos=(2,)),
}

_ALIASES = {name.lower(): name for name in MODELS}


def resolve_model_spec(name_or_path: str | Path | ModelConfig) -> tuple[str, ModelConfig]:
    """``(display name, shape)`` from a known name (case-insensitive, ``Qwen/`` prefixes
    allowed), a ``config.json`` file, or a model directory holding one."""
    if isinstance(name_or_path, ModelConfig):
        return name_or_path.architecture, name_or_path
    text = str(name_or_path)
    key = text.rsplit("/", 1)[-1].lower()
    if key in _ALIASES and not Path(text).exists():
        name = _ALIASES[key]
        return name, MODELS[name]
    path = Path(text)
    if path.is_dir():
        return path.name, ModelConfig.from_dir(path)
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
        return path.parent.name or path.stem, ModelConfig.from_dict(cfg)
    raise ModelLoadError(
        f"unknown model {text!r}: give a config.json, a model directory, or one of "
        f"{', '.join(MODELS)}"
    )
