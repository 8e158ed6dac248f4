"""The tiny model's tokenizer: a byte-level BPE trained here on the synthetic corpus
(:mod:`hlserve.models.tiny_corpus`), its special tokens, chat template and tokenizer files."""

from __future__ import annotations

import functools
from typing import Any

from hlserve.models.tiny_corpus import corpus

# Ids 0, 1, 2 in that order: the trainer puts special tokens first.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BOS_TOKEN, _IM_START, EOS_TOKEN = SPECIAL_TOKENS
PAD_TOKEN = BOS_TOKEN

# 256 byte tokens + 3 special tokens + merges. A power of two keeps the embedding tidy; the
# corpus below is rich enough for the trainer to reach it.
TOKENIZER_VOCAB_SIZE = 4096

# ChatML with Qwen2.5's tool format. No default system prompt, so that a rendered prompt is
# exactly what the caller sent; with ``tools``, Qwen2.5's tool block opens the system turn
# (the caller's system message, if any, first). An assistant turn's ``tool_calls`` render as
# <tool_call> JSON after its content (which may be None); consecutive ``tool`` messages are
# one user turn of <tool_response> blocks, as in Qwen2.5's template.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{{- '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{%- for tc in message.get('tool_calls') or [] %}"
    "{%- set fn = tc['function'] if tc['function'] is defined else tc %}"
    "{%- if loop.first and message['content'] is string and message['content'] %}{{- '\\n' }}"
    "{%- elif not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + fn['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# Qwen2's pre-tokenizer regex (also transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@functools.lru_cache(maxsize=1)
def trained_tokenizer_json() -> str:
    """Train the byte-level BPE once per process and return its tokenizer.json text.

    BPE training is deterministic for a given corpus (merge ties are broken by pair ids, the
    initial byte alphabet is fixed), so every process writes the same file.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    # Qwen2's pipeline (NFC, Qwen's split regex, then bytes to printable characters), not
    # GPT-2's: transformers 5 ignores tokenizer.json's pipeline for model_type "qwen2" and
    # rebuilds exactly this one around our vocab and merges, so any other choice would make
    # transformers and the `tokenizers` library disagree on the token ids of the same text.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok.to_str(pretty=True)


def special_tokens_map() -> dict[str, Any]:
    return {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [_IM_START, EOS_TOKEN],
    }


def tokenizer_config(ids: dict[str, int], model_max_length: int) -> dict[str, Any]:
    added = {
        str(ids[tok]): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [_IM_START, EOS_TOKEN],
        # No BOS in prompts, as in Qwen: the chat template carries the structure.
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        # transformers would otherwise "clean up" spaces before punctuation on decode and break
        # the byte-exact round trip.
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
