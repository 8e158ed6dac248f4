"""The offline API: ``LLM(model, **engine_options).generate(prompts, sampling_params)``, an
engine on the real runner built by the one factory (``engine/factory.py:build_engine``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from hlserve.config import EngineConfig
from hlserve.engine.args import make_config
from hlserve.engine.factory import build_engine
from hlserve.errors import EngineDeadError, InvalidRequestError
from hlserve.models.resolve import is_instruct, resolve_model
from hlserve.request import Request, RequestOutput, SamplingParams, merge_choices
from hlserve.runner.torch_runner import TorchRunner
from hlserve.tokenizer import Tokenizer

__all__ = ["LLM"]

Prompt = str | Sequence[int]
MAX_IDLE_PASSES = 1000


class LLM:
    """``LLM(model, **engine_options)``: ``model`` a directory, a .gguf file or a named real
    model (models/resolve.py); the options as ``engine/args.py:make_config`` takes them, a
    keyword passed explicit, None included (``LLM(model, preset="vllm", chunk_size=None)``:
    the preset without chunking); or :meth:`from_config` on a config already made. The
    engine it runs is :attr:`engine`."""

    def __init__(self, model: str, **engine_options: Any) -> None:
        self._start(make_config(resolve_model(model), **engine_options), is_instruct(model))

    @classmethod
    def from_config(cls, config: EngineConfig, *, instruct: bool = False) -> LLM:
        """An LLM on ``config`` as built (``hlserve generate`` builds it from its flags);
        ``instruct``: the model given was an instruct checkpoint (``models.resolve``)."""
        llm = cls.__new__(cls)
        llm._start(config, instruct)
        return llm

    def _start(self, config: EngineConfig, instruct: bool) -> None:
        # the model's tokenizer when it has one, loaded after the weights
        self.engine = build_engine(config, TorchRunner, tokenizer=Tokenizer.from_dir)
        self.tokenizer = self.engine.tokenizer
        # an instruct checkpoint (GGUF or a named model): ``hlserve generate`` chats with it
        self.instruct = instruct

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in prompt order.

        Every prompt is checked before any is submitted: a bad one raises
        :class:`InvalidRequestError` naming its index, and the engine stays usable.
        """
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        ids = []
        for i, (prompt, p) in enumerate(zip(batch, params, strict=True)):
            try:
                ids.append(self.engine.check_request(prompt, p))
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompt {i}: {e}") from None
        order: dict[str, tuple[int, int]] = {}  # request id -> (prompt, sequence)
        for i, (prompt_ids, p) in enumerate(zip(ids, params, strict=True)):
            for j, r in enumerate(self._fork(prompt_ids, p)):
                order[r.request_id] = (i, j)
        seqs: list[list[RequestOutput | None]] = [[None] * p.num_sequences for p in params]
        self._run(order, seqs, use_tqdm)
        return [merge_choices(s, p) for s, p in zip(seqs, params, strict=True)]  # type: ignore[arg-type]

    def _fork(self, prompt_ids: list[int], p: SamplingParams) -> list[Request]:
        """The prompt's sequences: one, or n / best_of siblings following the first."""
        if p.num_sequences == 1:
            return [self.engine.add_request(prompt_ids, p)]
        reqs: list[Request] = []
        for j in range(p.num_sequences):
            reqs.append(self.engine.add_request(
                prompt_ids, p.for_sibling(j), follows=reqs[0].request_id if reqs else None))
        return reqs

    def _run(self, order: dict[str, tuple[int, int]], seqs: list[list[RequestOutput | None]],
             use_tqdm: bool) -> None:
        bar = tqdm(total=len(order), desc="generate", unit="req",
                   disable=not use_tqdm or len(order) < 2)
        idle = 0  # passes in a row that neither ran a step nor ended a request
        with bar:
            while self.engine.has_unfinished():
                steps = self.engine.num_steps
                outs = self.engine.step()
                for out in outs:
                    if out.finished and out.request_id in order:
                        i, j = order[out.request_id]
                        seqs[i][j] = out
                        bar.update(1)
                idle = 0 if outs or self.engine.num_steps > steps else idle + 1
                if idle >= MAX_IDLE_PASSES:  # a scheduler bug must not hang the caller
                    raise EngineDeadError(
                        f"the engine made no progress in {idle} passes with "
                        f"{len(self.engine.waiting)} requests waiting")
        assert all(o is not None for s in seqs for o in s)

    def chat(
        self,
        messages: list[dict[str, Any]],
        sampling_params: SamplingParams | None = None,
    ) -> RequestOutput:
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer")
        # special-token text in the messages stays text (see Tokenizer.encode_chat)
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=True)
        return self.generate([ids], sampling_params, use_tqdm=False)[0]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one token-id prompt
    return items


def _as_params_list(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return params
