"""The synthetic corpus the tiny model's tokenizer is trained on: English prose, Python,
JavaScript, JSON, tool calls, shell sessions and chat turns (agent traffic), deterministic."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any


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


def corpus() -> Iterator[str]:
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
