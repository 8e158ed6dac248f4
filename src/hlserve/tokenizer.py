"""Tokenizer of a Hugging Face model directory, without transformers.

``tokenizer.json`` is read by the ``tokenizers`` library; the chat template and special tokens
come from ``tokenizer_config.json`` and the EOS ids also from ``generation_config.json``, as
transformers would read them. Text is streamed back through an incremental detokenizer that
never emits half a UTF-8 character.

A chat is rendered and tokenized by :meth:`Tokenizer.encode_chat`: the template's own special
tokens become control tokens, while special-token text inside what the client sent (message
content, tool definitions) is tokenized as plain text, so a user who writes ``<|im_end|>``
cannot end their turn and speak as the system.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from hlserve.errors import InvalidRequestError, ModelLoadError


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson`` for chat templates (what vLLM renders with), not jinja2's:
    keys in their order, no HTML escaping, non-ASCII kept; jinja2's sorts the keys and
    escapes, so a tool schema or tool-call arguments would reach the model reordered."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


# the arguments the renderer itself passes to a chat template: a request's
# ``chat_template_kwargs`` must not replace them
TEMPLATE_ARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                           "bos_token", "eos_token"})
# names a request's ``chat_template_kwargs`` must not set either: ``self`` (the render
# call's own), and the arguments of transformers' ``apply_chat_template`` that are options of
# that call rather than template variables. vLLM refuses ``chat_template`` and ``tokenize``
# (and, through transformers, ``conversation``) with a 400; the rest it hands to transformers,
# where they would truncate, pad or reshape the prompt: nothing here would honour them
CALL_ARGS = frozenset({"self", "conversation", "chat_template", "tokenize",
                       "continue_final_message", "padding", "truncation", "max_length",
                       "return_tensors", "return_dict", "return_assistant_tokens_mask",
                       "tokenizer_kwargs"})


class Tokenizer:
    def __init__(self, tok: HFTokenizer, config: dict[str, Any], generation: dict[str, Any]) -> None:
        self._tok = tok
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos: set[int] = set()
        if self.eos_token is not None and (i := tok.token_to_id(self.eos_token)) is not None:
            eos.add(i)
        gen_eos = generation.get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                  extensions=["jinja2.ext.loopcontrols"])
        self._env.filters["tojson"] = _tojson
        self._env.globals["raise_exception"] = _raise
        self._env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._compiled: tuple[str, Template] | None = None  # (its text, the template)
        self.special_tokens = tuple(sorted(
            (t.content for t in tok.get_added_tokens_decoder().values() if t.special),
            key=len, reverse=True))  # longest first: the alternation must prefer it
        self._special_re = (re.compile("|".join(map(re.escape, self.special_tokens)))
                            if self.special_tokens else None)
        self._plain: HFTokenizer | None = None  # a copy that never parses special tokens
        self._plain_lock = threading.Lock()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer | None:
        """The directory's tokenizer, or None when it ships none (token-id prompts only)."""
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            return None
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the library raises a bare Exception on a corrupt file
            raise ModelLoadError(f"{tok_file} could not be read: {e}") from None

        def read(name: str) -> dict[str, Any]:
            f = path / name
            if not f.is_file():
                return {}
            try:
                obj = json.loads(f.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"{f} is not valid JSON: {e}") from None
            if not isinstance(obj, dict):
                raise ModelLoadError(f"{f} must hold a JSON object, not {type(obj).__name__}")
            return obj

        return cls(tok, read("tokenizer_config.json"), read("generation_config.json"))

    def to_json(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what a grammar engine indexes)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """``text`` tokenized with special-token text taken as ordinary text. A second
        tokenizer object, not a flag flipped on the shared one: encodes run in worker
        threads concurrently."""
        if self._plain is None:
            with self._plain_lock:
                if self._plain is None:
                    plain = HFTokenizer.from_str(self._tok.to_str())
                    plain.encode_special_tokens = True
                    self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    @property
    def template_args(self) -> frozenset[str]:
        """Names a request's ``chat_template_kwargs`` must not set: what the renderer passes
        (and ``self``, and transformers' call options: CALL_ARGS) and the template
        environment's globals (``raise_exception``, ``range``, ...)."""
        return TEMPLATE_ARGS | CALL_ARGS | frozenset(self._env.globals)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Render ``messages`` with the chat template and tokenize the result, the template's
        special tokens as control tokens and any special-token text in the client's strings
        (messages, ``tools``, ``kwargs``) as plain text.

        Such text is swapped for a marker that holds a per-call nonce (ASCII, so ``tojson``
        keeps it), the chat is rendered, and the rendered text is tokenized piece by piece:
        between markers as usual, each marker's original text with :meth:`encode_plain`.
        Content without special-token text is tokenized exactly as ``encode(render(...))``.
        """
        found: list[str] = []
        nonce = secrets.token_hex(8)
        marker = re.compile(rf"\[\[hlserve-{nonce}-(\d+)\]\]")
        if self._special_re is not None:

            def swap(m: re.Match[str]) -> str:
                found.append(m.group(0))
                return f"[[hlserve-{nonce}-{len(found) - 1}]]"

            messages = _map_strings(messages, lambda t: self._special_re.sub(swap, t))
            kwargs = _map_strings(kwargs, lambda t: self._special_re.sub(swap, t))
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        if not found:
            return self.encode(text, add_special_tokens=False)
        ids: list[int] = []
        pos = 0
        for m in marker.finditer(text):
            ids += self.encode(text[pos:m.start()], add_special_tokens=False)
            ids += self.encode_plain(found[int(m.group(1))])
            pos = m.end()
        ids += self.encode(text[pos:], add_special_tokens=False)
        return ids

    def token_str(self, token_id: int) -> str | None:
        """The vocabulary's own string for an id (``Ġhello``), as HF's
        ``convert_ids_to_tokens`` gives it: what vLLM's ``/tokenize`` returns."""
        return self._tok.id_to_token(token_id)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use the completions API")
        try:
            # one mapping, not keywords: no name in ``kwargs`` can clash with render's own
            return self._template().render({
                **kwargs, "messages": messages, "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""})
        except Exception as e:  # the template's error on what the client sent
            # TemplateError, TypeError (messages not a list of dicts), and whatever a
            # template's operation raises on a client's value (range() too long: an
            # OverflowError; a division by zero...): the client's 400, as vLLM answers
            # any error from rendering (safe_apply_chat_template)
            raise InvalidRequestError(f"chat template failed on these messages: "
                                      f"{type(e).__name__}: {e}") from None

    def _template(self) -> Template:
        """The chat template compiled, once per template text: compiling the tiny test
        model's took tens of milliseconds of every chat request, rendering it 0.07 ms. A
        compiled template renders from any thread."""
        text = self.chat_template or ""
        cached = self._compiled
        if cached is None or cached[0] != text:
            cached = (text, self._env.from_string(text))
            self._compiled = cached
        return cached[1]


def _map_strings(obj: Any, fn: Any) -> Any:
    """``obj`` (JSON-like) with ``fn`` applied to every string value; keys are kept."""
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_strings(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_map_strings(v, fn) for v in obj]
    return obj


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding token by token breaks multi-byte characters and merges that span tokens, so each
    step decodes a short window (from ``prefix`` on) and emits only what is new and complete.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        done = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        now = self.tok.decode(self.ids[self.prefix :], self.skip)
        if len(now) > len(done) and (final or not now.endswith("\ufffd")):
            delta = now[len(done) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
            return delta
        return ""
