"""The embedded default model: random weights in Hugging Face format, made locally.

hlserve must run end to end (engine, server, benchmarks, tests) on a machine that cannot reach
a model hub. ``make_tiny_model`` writes a complete Hugging Face model directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json, special_tokens_map.json,
generation_config.json) that ``transformers`` loads as it would a real checkpoint, so the same
directory serves as the engine's default model and as the reference for correctness tests.

- Weights are random (normal, std 0.02; RMSNorm weights near 1), drawn from a seeded
  ``torch.Generator``: the same seed gives byte-identical files.
- The tokenizer is a byte-level BPE trained here, with the ``tokenizers`` library, on a corpus
  generated here (English prose, Python, JSON, tool calls, shell: agent traffic). It does not
  depend on the seed, and is trained once per process.
- ``size="0.5b"`` has exactly the Qwen2.5-0.5B shape, for memory and speed work at real scale.
  Tensors are generated and written one at a time, so memory stays near the largest tensor.
"""

from __future__ import annotations

import functools
import json
import math
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["ARCHS", "CHAT_TEMPLATE", "DTYPES", "SIZES", "SPECIAL_TOKENS", "make_tiny_model"]

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

DTYPES: dict[str, tuple[torch.dtype, str]] = {
    # name -> (torch dtype, safetensors dtype tag)
    "float32": (torch.float32, "F32"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
}

INIT_STD = 0.02
NORM_JITTER = 0.1  # RMSNorm weights are 1 + NORM_JITTER * N(0, 1): not 1, so a skipped norm shows
# Bias std larger than INIT_STD: a q/v projection output has std ~ INIT_STD * sqrt(hidden) (0.3
# for tiny), so a 0.02 bias would barely move it and an engine that drops the bias could pass.
BIAS_STD = 0.1


@dataclass(frozen=True)
class _Arch:
    architecture: str
    model_type: str
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool  # for size "tiny"; "0.5b" is always tied, like Qwen2.5-0.5B
    rope_theta: float  # for size "tiny"; "0.5b" uses Qwen2.5's 1e6
    rms_norm_eps: float


ARCHS: dict[str, _Arch] = {
    "llama": _Arch("LlamaForCausalLM", "llama", False, False, False, 10000.0, 1e-5),
    "qwen2": _Arch("Qwen2ForCausalLM", "qwen2", True, False, True, 1e6, 1e-6),
    "qwen3": _Arch("Qwen3ForCausalLM", "qwen3", False, True, True, 1e6, 1e-6),
}


@dataclass(frozen=True)
class _Shape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None  # None: the trained tokenizer's size
    max_position_embeddings: int
    # Overrides of the architecture's defaults (None: keep the arch's value).
    tie_word_embeddings: bool | None = None
    rope_theta: float | None = None


SIZES: dict[str, _Shape] = {
    # A few million parameters; GQA with 4 query heads per KV head, like the real models.
    "tiny": _Shape(256, 4, 8, 2, 32, 768, None, 32768),
    # Qwen2.5-0.5B exactly. The embedding (151936 rows) is larger than the tokenizer, as in Qwen.
    "0.5b": _Shape(
        896, 24, 14, 2, 64, 4864, 151936, 32768, tie_word_embeddings=True, rope_theta=1e6
    ),
    # Qwen2.5-7B exactly (~15 GB in bf16): for GPU checks (benchmarks/gpu_check.py).
    "7b": _Shape(
        3584, 28, 28, 4, 128, 18944, 152064, 32768, tie_word_embeddings=False, rope_theta=1e6
    ),
}


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a random-weight model in Hugging Face format to ``out_dir`` and return its path.

    ``arch``: "llama", "qwen2" or "qwen3"; ``size``: "tiny" (a few million parameters) or
    "0.5b" (the Qwen2.5-0.5B shape); ``dtype``: "float32", "bfloat16" or "float16". The same
    arguments always produce byte-identical files. Nothing is downloaded.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}: choose from {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: choose from {', '.join(SIZES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose from {', '.join(DTYPES)}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json = _trained_tokenizer_json()
    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    ids = {tok: vocab[tok] for tok in SPECIAL_TOKENS}

    config = _model_config(ARCHS[arch], SIZES[size], len(vocab), ids, dtype)
    # Weights first, through a temporary name, and config.json last: a directory that has a
    # config.json is complete, even if an earlier call was interrupted mid-write.
    tmp = out / "model.safetensors.tmp"
    _write_weights(tmp, _param_specs(config, ARCHS[arch]), seed, dtype)
    tmp.replace(out / "model.safetensors")
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(ids, config))
    _write_json(out / "special_tokens_map.json", _special_tokens_map())
    _write_json(out / "generation_config.json", _generation_config(ids))
    _write_json(out / "config.json", config)
    return out


# ---------------------------------------------------------------------------------------------
# config files


def _model_config(
    arch: _Arch, shape: _Shape, tokenizer_size: int, ids: dict[str, int], dtype: str
) -> dict[str, Any]:
    vocab_size = shape.vocab_size or tokenizer_size
    if vocab_size < tokenizer_size:
        raise ValueError(f"embedding ({vocab_size}) smaller than tokenizer ({tokenizer_size})")
    tie = (
        arch.tie_word_embeddings if shape.tie_word_embeddings is None else shape.tie_word_embeddings
    )
    theta = arch.rope_theta if shape.rope_theta is None else shape.rope_theta
    cfg: dict[str, Any] = {
        "architectures": [arch.architecture],
        "model_type": arch.model_type,
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "initializer_range": INIT_STD,
        "rms_norm_eps": arch.rms_norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, older readers (and hlserve's
        # ModelConfig) read the top-level rope_theta.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_dropout": 0.0,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if arch.model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        # Qwen2's config has no attention_bias field (its q/k/v bias is hard-wired), so it is
        # left out there, as in real Qwen2 checkpoints; Qwen3 has the field and it is false.
        if arch.model_type == "qwen3":
            cfg["attention_bias"] = False
        cfg.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=shape.num_hidden_layers,
        )
    return cfg


def _generation_config(ids: dict[str, int]) -> dict[str, Any]:
    return {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [_IM_START, EOS_TOKEN],
    }


def _tokenizer_config(ids: dict[str, int], model_cfg: dict[str, Any]) -> dict[str, Any]:
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
        "model_max_length": model_cfg["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# weights


@dataclass(frozen=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    init: str  # "normal" (std INIT_STD), "bias" (std BIAS_STD) or "norm" (1 + jitter)


def _param_specs(cfg: dict[str, Any], arch: _Arch) -> list[_Param]:
    """Every tensor of the checkpoint, with Hugging Face names, in a fixed order."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    specs = [_Param("model.embed_tokens.weight", (cfg["vocab_size"], h), "normal")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs.append(_Param(p + "input_layernorm.weight", (h,), "norm"))
        for proj, out_dim in (("q", q), ("k", kv), ("v", kv)):
            specs.append(_Param(f"{p}self_attn.{proj}_proj.weight", (out_dim, h), "normal"))
            if arch.qkv_bias:
                specs.append(_Param(f"{p}self_attn.{proj}_proj.bias", (out_dim,), "bias"))
        if arch.qk_norm:
            specs.append(_Param(p + "self_attn.q_norm.weight", (cfg["head_dim"],), "norm"))
            specs.append(_Param(p + "self_attn.k_norm.weight", (cfg["head_dim"],), "norm"))
        specs.append(_Param(p + "self_attn.o_proj.weight", (h, q), "normal"))
        specs.append(_Param(p + "post_attention_layernorm.weight", (h,), "norm"))
        specs.append(_Param(p + "mlp.gate_proj.weight", (inter, h), "normal"))
        specs.append(_Param(p + "mlp.up_proj.weight", (inter, h), "normal"))
        specs.append(_Param(p + "mlp.down_proj.weight", (h, inter), "normal"))
    specs.append(_Param("model.norm.weight", (h,), "norm"))
    if not cfg["tie_word_embeddings"]:
        specs.append(_Param("lm_head.weight", (cfg["vocab_size"], h), "normal"))
    return specs


def _init_tensor(param: _Param, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    # Always drawn in float32 and then cast, so a bf16 model is the rounded fp32 model of the
    # same seed rather than an unrelated one.
    t = torch.empty(param.shape, dtype=torch.float32)
    if param.init == "norm":
        t.normal_(0.0, NORM_JITTER, generator=gen).add_(1.0)
    else:
        t.normal_(0.0, BIAS_STD if param.init == "bias" else INIT_STD, generator=gen)
    return t.to(dtype)


def _write_weights(path: Path, specs: list[_Param], seed: int, dtype: str) -> None:
    """Write a safetensors file one tensor at a time.

    ``safetensors.torch.save_file`` needs every tensor in memory at once (and older versions
    copy them again): 2-4 GB for the 0.5b model in float32. The format is simple enough
    (8-byte header length, JSON header, raw little-endian data) to stream instead.
    """
    torch_dtype, tag = DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in specs:
        nbytes = itemsize * math.prod(p.shape)
        header[p.name] = {
            "dtype": tag,
            "shape": list(p.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data must start 8-byte aligned

    gen = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for p in specs:
            t = _init_tensor(p, gen, torch_dtype)
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)


# ---------------------------------------------------------------------------------------------
# tokenizer


# Qwen2's pre-tokenizer regex (also transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
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
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok.to_str(pretty=True)


def _words(text: str) -> list[str]:
    return text.split()


# Word lists for the generated corpus. Plenty of distinct words matter more than volume: BPE can
# only merge inside words, so the vocabulary size it reaches is bounded by word variety.
_NOUNS = _words("""
time person year way day thing man world life hand part child eye woman place work week case
point government company number group problem fact request response server client model token
cache memory page batch queue scheduler engine worker thread process file directory path user
agent tool function argument result error message system prompt context window budget chunk
prefill decode throughput latency kernel tensor layer head vector matrix weight bias norm value
key query index table record field column row database schema network socket port address host
service endpoint route handler session cookie header body status code version release branch
commit patch review test suite fixture report metric counter gauge histogram trace span log
event signal timer clock deadline retry backoff limit quota price order invoice customer account
product item cart payment shipment warehouse inventory city country river mountain forest ocean
weather forecast temperature rain snow wind morning evening night summer winter spring autumn
book chapter paper author title story language word sentence letter number answer question idea
plan goal step task project team meeting email calendar document spreadsheet slide chart image
""")

_VERBS = _words("""
run read write open close send receive return call check update create delete build test deploy
start stop restart schedule allocate release evict compute measure compare sort filter search
parse format validate encode decode load save fetch store print render handle raise catch log
find list count merge split join map reduce train serve stream cancel retry wait notify resolve
explain summarize translate answer describe improve fix review plan estimate analyze predict
""")

_ADJECTIVES = _words("""
new old large small fast slow long short high low early late good bad simple complex local remote
empty full valid invalid active idle ready busy stale fresh cached shared private public optional
required default current previous next first last final total average maximum minimum random
greedy strict relaxed quiet noisy warm cold bright dark careful quick safe stable
""")

_ADVERBS = _words("quickly slowly carefully always never often rarely already soon again only")

_NAMES = _words("""
alice bob carol dave erin frank grace heidi ivan judy mallory oscar peggy trent victor walter
paris london tokyo berlin madrid rome sydney toronto chicago boston seattle denver austin
""")

_TOOLS = _words("""
get_weather search_web read_file write_file list_directory run_shell execute_python query_database
send_email create_ticket get_stock_price translate_text summarize_document fetch_url calculator
get_current_time book_flight lookup_order update_record git_diff run_tests
""")

_PY_SNIPPETS = (
    'def {f}({a}, {b}=None):\n    """{doc}"""\n    if {b} is None:\n        {b} = []\n'
    "    for {i} in range(len({a})):\n        {b}.append({a}[{i}] * 2)\n    return {b}\n",
    "class {C}:\n    def __init__(self, {a}: int, {b}: str) -> None:\n        self.{a} = {a}\n"
    "        self.{b} = {b}\n\n    def __repr__(self) -> str:\n"
    '        return f"{C}({a}={{self.{a}!r}}, {b}={{self.{b}!r}})"\n',
    "import json\nimport os\n\nwith open(os.path.join({q}{a}{q}, {q}{b}.json{q})) as fh:\n"
    "    data = json.load(fh)\nprint(data.get({q}{i}{q}, {n}))\n",
    "async def {f}(session, {a}):\n    try:\n        resp = await session.get({q}/api/{a}/{n}{q})\n"
    "        resp.raise_for_status()\n    except TimeoutError as exc:\n"
    "        raise RuntimeError({q}{doc}{q}) from exc\n    return await resp.json()\n",
    "{a} = [{n}, {m}, {k}]\n{b} = {{x: x ** 2 for x in {a} if x % 2 == 0}}\n"
    "assert sum({b}.values()) >= 0, {q}{doc}{q}\n",
    "for {i}, ({a}, {b}) in enumerate(zip(xs, ys)):\n    if {a} != {b}:\n"
    "        logger.warning({q}mismatch at %d: %s != %s{q}, {i}, {a}, {b})\n        break\n",
)

_SHELL_SNIPPETS = (
    '$ git commit -m "{doc}"\n[main {hex}] {doc}\n {n} files changed, {m} insertions(+)\n',
    "$ ls -la /home/{name}/{a}\ntotal {n}\n-rw-r--r-- 1 {name} staff {m} Mar {k} 10:{k2} {b}.py\n",
    '$ curl -s http://localhost:{port}/v1/{a} | jq .{b}\n{{"{b}": {n}}}\n',
    "$ python -m pytest tests/test_{a}.py -q\n{n} passed, {k} skipped in {m}.{k2}s\n",
    '$ grep -rn "{f}" src/ | head -{k}\nsrc/{a}/{b}.py:{n}:def {f}({a}):\n',
)


def _corpus() -> Iterator[str]:
    """Yield a deterministic few-hundred-KB corpus shaped like agent traffic.

    A fixed internal seed (not the model seed): the tokenizer is the same for every model.
    """
    rng = random.Random(20240601)
    gens = (
        _prose,
        _python,
        _javascript,
        _json_record,
        _tool_call,
        _shell,
        _chat_turn,
        _multilingual,
    )
    weights = (5, 3, 1, 2, 2, 1, 2, 1)
    for _ in range(3000):
        yield rng.choices(gens, weights)[0](rng)


_WORDS = _NOUNS + _VERBS + _ADJECTIVES


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS)


def _ident(rng: random.Random) -> str:
    return "_".join(_word(rng) for _ in range(rng.randint(1, 3)))


def _camel(rng: random.Random) -> str:
    # camelCase runs are single pre-tokens (letters only), so they feed the trainer new words
    # where snake_case, split at each "_", would not.
    words = [_word(rng) for _ in range(rng.randint(2, 3))]
    return words[0] + "".join(w.capitalize() for w in words[1:])


def _sentence(rng: random.Random) -> str:
    subject = f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    if rng.random() < 0.3:
        subject = rng.choice(_NAMES).capitalize()
    verb = rng.choice(_VERBS)
    verb = (
        verb + ("s" if not verb.endswith("s") else "es") if rng.random() < 0.5 else f"will {verb}"
    )
    obj = f"{rng.choice(['a', 'the', 'every', 'no'])} {rng.choice(_NOUNS)}"
    tail = rng.choice(
        [
            "",
            f" {rng.choice(_ADVERBS)}",
            f" in {rng.randint(2, 999)} ms",
            f" for {rng.choice(_NAMES).capitalize()}",
            f" when the {rng.choice(_NOUNS)} is {rng.choice(_ADJECTIVES)}",
            f" ({rng.randint(1, 100)}%)",
        ]
    )
    s = f"{subject} {verb} {obj}{tail}"
    return s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?", ";", ","])


def _prose(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) + "\n"


def _python(rng: random.Random) -> str:
    return rng.choice(_PY_SNIPPETS).format(
        f=_ident(rng),
        C="".join(w.capitalize() for w in _ident(rng).split("_")),
        a=rng.choice(_NOUNS),
        b=rng.choice(_NOUNS) + "s",
        i=rng.choice("ijkn"),
        n=rng.randint(0, 4096),
        m=rng.randint(0, 99),
        k=rng.randint(1, 9),
        q=rng.choice("'\""),
        doc=_sentence(rng),
    )


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(6 if depth < 2 else 4)
    if kind == 0:
        return rng.randint(-1000, 100000)
    if kind == 1:
        return round(rng.uniform(-100, 100), rng.randint(1, 4))
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return " ".join(_word(rng) for _ in range(rng.randint(1, 5)))
    if kind == 4:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    key = _camel if rng.random() < 0.5 else _ident
    return {key(rng): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))}


def _json_record(rng: random.Random) -> str:
    obj = {_ident(rng): _json_value(rng) for _ in range(rng.randint(2, 6))}
    return json.dumps(obj, indent=rng.choice([None, 2])) + "\n"


def _javascript(rng: random.Random) -> str:
    f, a, b = _camel(rng), _camel(rng), rng.choice(_NOUNS)
    return (
        f"export async function {f}({a}, {{ {b}, timeoutMs = {rng.randint(100, 9000)} }}) {{\n"
        f"  const {b}List = await fetch(`/api/${{{a}}}/{b}`).then((r) => r.json());\n"
        f"  return {b}List.filter((x) => x.{_camel(rng)} !== null).map((x) => x.{_camel(rng)});\n"
        "}\n"
    )


def _tool_call(rng: random.Random) -> str:
    name = rng.choice(_TOOLS)
    args = {_ident(rng): _json_value(rng, 1) for _ in range(rng.randint(1, 3))}
    call = json.dumps({"name": name, "arguments": args})
    result = json.dumps({"status": rng.choice(["ok", "error"]), "result": _json_value(rng, 1)})
    return (
        f"<tool_call>\n{call}\n</tool_call>\n"
        f"<tool_response>\n{result}\n</tool_response>\n"
        f"The {name} tool returned {rng.choice(_ADJECTIVES)} data. {_sentence(rng)}\n"
    )


def _shell(rng: random.Random) -> str:
    return rng.choice(_SHELL_SNIPPETS).format(
        doc=_sentence(rng),
        hex=f"{rng.getrandbits(28):07x}",
        n=rng.randint(1, 500),
        m=rng.randint(1, 9999),
        k=rng.randint(1, 9),
        k2=rng.randint(10, 59),
        name=rng.choice(_NAMES),
        a=rng.choice(_NOUNS),
        b=_ident(rng),
        f=_ident(rng),
        port=rng.choice([8000, 8080, 30000, 5000]),
    )


def _chat_turn(rng: random.Random) -> str:
    # Without the special tokens: the trainer does not split them out of the corpus, and merges
    # spent on "<|im_" pieces would be wasted (they always encode as single special tokens).
    return (
        f"system\nYou are a {rng.choice(_ADJECTIVES)} assistant. Use the "
        f"{rng.choice(_TOOLS)} tool when needed.\n"
        f"user\n{_sentence(rng)}\n"
        f"assistant\n{_prose(rng)}\n"
    )


_MULTILINGUAL = (
    "Café, naïve, résumé, façade, jalapeño, über, Straße, smørrebrød, crème brûlée.",
    "Привет, мир! Как дела? Всё хорошо, спасибо.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "こんにちは世界。東京は晴れです。",
    "안녕하세요, 세계! 오늘 날씨가 좋네요.",
    "مرحبا بالعالم",
    "Γειά σου Κόσμε! αβγδε λμνξο",
    "Emoji: 🚀 ✅ 🤖 🔥 👍 — “quotes” and ‘single’ … ellipsis • bullet ± ≤ ≥ ≠ → ∞ €100 £50 ¥1000",
)


def _multilingual(rng: random.Random) -> str:
    return rng.choice(_MULTILINGUAL) + " " + _sentence(rng) + "\n"
