"""Load a Hugging Face model directory (config.json + safetensors) into :class:`CausalLM`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hlserve.errors import ModelLoadError
from hlserve.models.llama import CausalLM, rope_inv_freq
from hlserve.models.model_config import ModelConfig

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype, except fp16 on CPU (slow there) becomes bf16."""
    if name == "auto":
        dtype = DTYPES.get(cfg.torch_dtype, torch.float32)
        if dtype == torch.float16 and device.type == "cpu":
            return torch.bfloat16
        return dtype
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use auto, {', '.join(DTYPES)}") from None


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{str(model_dir)!r} holds no *.safetensors weights (only safetensors checkpoints load)"
        )
    return files


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device
) -> tuple[CausalLM, ModelConfig]:
    path = Path(model_dir)
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    expected = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in safetensors_files(path):
        try:
            _load_file(file, expected, loaded, cfg, dtype)
        except SafetensorError as e:
            raise ModelLoadError(f"{file.name} is not a readable safetensors file: {e}") from None
    missing = set(expected) - loaded - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[0]!r}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # the RoPE table is a buffer that to_empty left uninitialised; it stays fp32
    model.rotary.inv_freq = rope_inv_freq(cfg).to(device)
    model.eval().requires_grad_(False)
    return model, cfg


def _load_file(
    file: Path, expected: dict[str, torch.nn.Parameter], loaded: set[str], cfg: ModelConfig,
    dtype: torch.dtype,
) -> None:
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            if "rotary_emb" in name or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if name not in expected:
                raise ModelLoadError(f"{file.name}: unexpected tensor {name!r} for {cfg.architecture}")
            tensor = f.get_tensor(name)
            param = expected[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ModelLoadError(
                    f"{file.name}: {name} has shape {tuple(tensor.shape)}, "
                    f"config.json implies {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor.to(dtype))
            loaded.add(name)
