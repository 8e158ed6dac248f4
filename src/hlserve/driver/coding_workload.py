"""The coding-pipeline workload (issue 24): agent sessions that edit the files of one shared,
synthetic Python repository, as text through the model's chat template.

Outputs that copy long spans of the prompt are where speculative decoding pays (n-gram and
suffix proposers find the continuation in the context), and coding agents are such a
workload: "rename X to Y and return the full file". So:

- :class:`Repository`: ``files`` Python modules generated from a seed (plausible functions:
  loops, filters, lookups, counters, formatters, with docstrings and constants), plus a
  ``common.py`` every session sees in its system prompt.
- :class:`CodingWorkload`: sessions of ``rounds`` rounds. Round r's user message quotes one or
  more files of the repository (the shared original, so sessions quoting the same file share
  that text) and asks for one edit of the last one (rename a function, a parameter, change a
  constant) with the full edited file as the reply. The file comes first and the instruction
  after it, so that two sessions' first rounds on the same file share the prompt up to the
  instruction (the prefix cache's reuse across sessions). Session i's first file is file
  ``i mod files``; later files and every instruction come from a generator seeded by
  (seed, session, round): the same workload always asks the same.
- :class:`CodingSession`: the conversation so far (system, then each round's user message and
  the model's real reply, decoded) rendered by a :class:`ChatCodec` (hlserve's
  ``Tokenizer``) into the prompt's ids. It duck-types the agent session of
  :mod:`hlserve.driver.workloads` (``next_request``, ``complete``, ``done``) for the drivers, and its
  outputs are not pinned (``ignore_eos`` False): a reply ends at the model's end of turn, or
  at ``max_tokens``.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass, field
from string import Template
from typing import Any, Protocol

from hlserve.driver.tool_time import NO_TOOL_TIME, ToolTime, check_drawn, draw_pause, tool_rng

VERBS = ("compute", "load", "parse", "merge", "filter", "count", "build", "find", "update",
         "format", "check", "collect", "group", "scale", "split", "render")
NOUNS = ("totals", "users", "orders", "records", "settings", "items", "scores", "events",
         "paths", "tokens", "rows", "prices", "invoices", "sessions", "reports", "tasks")
# none of them a noun or a word of a body below (a whole-word rename must change the
# parameter only)
COLLECTIONS = ("values", "data", "entries", "table", "keys", "batch", "source")  # $A
SCALARS = ("limit", "scale", "name", "threshold", "prefix", "width", "offset", "factor")  # $B
NEW_PARAMS = ("amount", "label", "mapping", "count", "bound", "sequence", "weight")

# function bodies: $F the name, $A and $B its parameters, $N the noun, $C the file's constant
BODIES = (
    '''def $F($A, $B):
    """Sum the $N of $A, each times $B."""
    total = 0
    for item in $A:
        total += item * $B
    return total
''',
    '''def $F($A, $B):
    """The $N of $A above $B, at most $C of them."""
    result = []
    for item in $A:
        if item > $B:
            result.append(item)
    return result[:$C]
''',
    '''def $F($A, $B, default=None):
    """Look $B up in $A; default when the $N have no such entry."""
    if $B in $A:
        return $A[$B]
    return default
''',
    '''def $F($A):
    """Count the $N of $A by their first letter."""
    counts = {}
    for value in $A:
        key = str(value)[:1]
        counts[key] = counts.get(key, 0) + 1
    return counts
''',
    '''def $F($A, $B):
    """Format the $N of $A as lines, each after $B."""
    lines = []
    for index, value in enumerate($A):
        lines.append(f"{$B}{index}: {value}")
    return "\\n".join(lines[:$C])
''',
    '''def $F($A, $B):
    """Split $A into groups of $B $N."""
    groups = []
    for start in range(0, len($A), $B):
        groups.append($A[start:start + $B])
    return groups
''',
)


class ChatCodec(Protocol):
    """What a session needs of a tokenizer: hlserve's ``Tokenizer`` is one."""

    def encode_chat(self, messages: list[dict[str, Any]],
                    add_generation_prompt: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class Function:
    name: str
    params: tuple[str, ...]
    text: str


@dataclass(frozen=True)
class SourceFile:
    path: str
    text: str
    functions: tuple[Function, ...]
    constant: str  # the file's one module-level constant


def _function(rng: random.Random, name: str, noun: str, constant: str) -> Function:
    body = rng.choice(BODIES)
    a, b = rng.choice(COLLECTIONS), rng.choice(SCALARS)
    text = Template(body).substitute(F=name, A=a, B=b, N=noun, C=constant)
    return Function(name, (a,) if "$B" not in body else (a, b), text)


def replace_word(text: str, old: str, new: str) -> str:
    """Every occurrence of the identifier ``old`` as a whole word (not inside another name)."""
    return re.sub(rf"\b{re.escape(old)}\b", new, text)


def make_file(rng: random.Random, path: str, noun: str, n_functions: int) -> SourceFile:
    """A module of ``n_functions`` functions on ``noun``, a docstring and a constant."""
    constant = f"MAX_{noun.upper()}"
    verbs = rng.sample(VERBS, n_functions)
    parts = [f'"""Helpers for the {noun} of the app package."""\n\nimport math\n\n'
             f"{constant} = {rng.randrange(8, 100)}\n"]
    functions = tuple(_function(rng, f"{verb}_{noun}", noun, constant) for verb in verbs)
    parts += [f.text for f in functions]
    return SourceFile(path, "\n\n".join(parts), functions, constant)


@dataclass(frozen=True)
class Task:
    """One round's ask: the files quoted (the last is edited), the instruction, and the file
    as the edit would leave it (what a perfect reply holds)."""

    files: tuple[SourceFile, ...]
    instruction: str
    expected: str
    old: str  # the identifier renamed
    new: str  # its new name

    @property
    def prompt(self) -> str:
        quoted = "\n".join(f"File `{f.path}`:\n```python\n{f.text}```\n" for f in self.files)
        return (f"{quoted}{self.instruction} Reply with the full edited file "
                f"`{self.files[-1].path}` in one code block.")


def edit_task(rng: random.Random, files: tuple[SourceFile, ...]) -> Task:
    """An edit of the last file: rename a function, rename a parameter of one, or change the
    constant; every occurrence changes (a plain textual replacement: the names are unique)."""
    target = files[-1]
    fn = rng.choice(target.functions)
    kind = rng.randrange(3)
    if kind == 0:
        noun = fn.name.split("_", 1)[1]
        taken = {f.name for f in target.functions}
        new = rng.choice([f"{v}_{noun}" for v in VERBS if f"{v}_{noun}" not in taken])
        instruction, old = f"Rename the function `{fn.name}` to `{new}`.", fn.name
    elif kind == 1:  # only inside that function
        old, new = rng.choice(fn.params), rng.choice(NEW_PARAMS)
        instruction = f"Rename the parameter `{old}` of `{fn.name}` to `{new}`."
        return Task(files, instruction,
                    target.text.replace(fn.text, replace_word(fn.text, old, new)), old, new)
    else:
        old, new = target.constant, target.constant.replace("MAX_", "LIMIT_")
        instruction = f"Rename the constant `{old}` to `{new}`."
    return Task(files, instruction, replace_word(target.text, old, new), old, new)


@dataclass(frozen=True)
class Repository:
    """``files`` modules under ``app/`` and ``app/common.py``, all from ``seed``."""

    files: int = 8
    functions: tuple[int, int] = (3, 4)  # per file, inclusive
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.files <= len(NOUNS) - 1:
            raise ValueError(f"a repository has 1..{len(NOUNS) - 1} files, got {self.files}")

    @functools.cached_property
    def sources(self) -> tuple[SourceFile, ...]:
        rng = random.Random(f"repo:{self.seed}")
        nouns = rng.sample(NOUNS, self.files + 1)
        return tuple(make_file(rng, f"app/{noun}.py", noun, rng.randint(*self.functions))
                     for noun in nouns[: self.files])

    @functools.cached_property
    def common(self) -> SourceFile:
        rng = random.Random(f"common:{self.seed}")
        return make_file(rng, "app/common.py", "values", 2)

    def system_prompt(self) -> str:
        listing = ", ".join(f"`{f.path}`" for f in self.sources)
        return ("You are a coding assistant working on the Python package `app`. You edit "
                "one file at a time and reply with the complete edited file in one ```python "
                f"code block, nothing else.\nThe package's files: {listing}.\nIts shared "
                f"helpers, `{self.common.path}`:\n```python\n{self.common.text}```")


@dataclass(frozen=True)
class CodingWorkload:
    sessions: int = 16
    rounds: int = 2
    files: int = 8  # in the shared repository
    files_per_round: int = 1  # quoted in each round's message; the last is edited
    max_tokens: int = 64  # per reply (it may end earlier, at the model's end of turn)
    seed: int = 0
    tool_time: ToolTime = NO_TOOL_TIME  # between a session's rounds, as the agent workload's

    def __post_init__(self) -> None:
        if not 1 <= self.files_per_round <= self.files:
            raise ValueError(f"files_per_round must be in 1..files ({self.files}), got "
                             f"{self.files_per_round}")
        if self.rounds < 1 or self.max_tokens < 1:
            raise ValueError("rounds and max_tokens must be >= 1")
        check_drawn(self.tool_time)

    @functools.cached_property
    def repo(self) -> Repository:
        return Repository(self.files, seed=self.seed)

    def task(self, session: int, rnd: int) -> Task:
        """Session ``session``'s round ``rnd``: the same workload always asks the same."""
        rng = random.Random(f"task:{self.seed}:{session}:{rnd}")
        n = self.files
        target = session % n if rnd == 0 else rng.randrange(n)
        others = sorted(rng.sample([i for i in range(n) if i != target], self.files_per_round - 1))
        files = tuple(self.repo.sources[i] for i in (*others, target))
        return edit_task(rng, files)

    def make_session(self, index: int, chat: ChatCodec) -> CodingSession:
        return CodingSession(self, index, chat)

    def sessions_list(self, chat: ChatCodec) -> list[CodingSession]:
        return [self.make_session(i, chat) for i in range(self.sessions)]


@dataclass
class CodingSession:
    workload: CodingWorkload
    session_id: int
    chat: ChatCodec
    round: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    # the drivers pin output lengths with ignore_eos unless a session says otherwise: a reply
    # here is the model's real edit, ended by its end of turn
    ignore_eos: bool = False
    tool_rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": self.workload.repo.system_prompt()}]
        self.tool_rng = tool_rng(self.workload.seed, self.session_id)

    @property
    def done(self) -> bool:
        return self.round >= self.workload.rounds

    def next_request(self) -> tuple[list[int], int]:
        """The prompt's ids (the whole conversation, rendered) and ``max_tokens``."""
        task = self.workload.task(self.session_id, self.round)
        self.messages.append({"role": "user", "content": task.prompt})
        return self.chat.encode_chat(self.messages), self.workload.max_tokens

    def complete(self, output_ids: list[int]) -> None:
        """The reply, decoded, becomes the assistant's message the next round renders."""
        text = self.chat.decode(list(output_ids))
        self.replies.append(text)
        self.messages.append({"role": "assistant", "content": text})
        self.round += 1

    def tool_pause(self, served: float = 0.0) -> float:
        """Seconds the tool call after the round just completed runs before the next round
        (the agent workload's rule: drawn from the session's own generator; ``served`` is
        not used)."""
        return draw_pause(self.workload.tool_time, self.tool_rng)
