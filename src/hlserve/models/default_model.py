"""The embedded default model (random weights, a locally trained tokenizer): where it lives
and how it is built on first use, for every command and benchmark that needs a model."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_HOME = Path(os.environ.get("HLSERVE_HOME", Path.home() / ".cache" / "hlserve"))


def default_model(size: str = "tiny", quiet: bool = False) -> Path:
    """The embedded default model's directory, built on first use (no download)."""
    from hlserve.models.tiny import make_tiny_model

    path = DEFAULT_MODEL_HOME / "models" / f"qwen2-{size}"
    if not (path / "config.json").exists():
        if not quiet:
            print(f"building the embedded default model at {path} ...", flush=True)
        make_tiny_model(path, arch="qwen2", size=size, seed=0)
    return path
