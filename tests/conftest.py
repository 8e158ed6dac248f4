"""Shared fixtures: the embedded tiny models, built once per test session (no download)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hlserve.models.cpu_kernels import decode_op
from hlserve.models.tiny import make_tiny_model


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the CPU attention kernels once, before any test starts a server that would
    otherwise pay the build inside its start-up timeout."""
    decode_op()

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch=arch, size="tiny", seed=1) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(autouse=True, scope="session")
def _threads() -> None:
    # CI machines have 2 cores; more threads than cores only adds contention
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
