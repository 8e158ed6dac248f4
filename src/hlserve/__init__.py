"""hlserve: an LLM serving engine and measurement framework for the agent era."""

from hlserve.errors import EngineDeadError, HLServeError, InvalidRequestError, ModelLoadError
from hlserve.request import RequestOutput, SamplingParams

__all__ = [
    "LLM",
    "EngineDeadError",
    "HLServeError",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str):  # the offline API pulls in torch: import it on first use
    if name == "LLM":
        from hlserve.llm import LLM

        return LLM
    raise AttributeError(name)
