"""Agent-shaped workloads as token ids, shared by every driver (in-process, HTTP, simulated).

A closed-loop agent session: round r's prompt is the shared system prompt (tool
definitions), then every earlier round's prompt additions and outputs, then a new tool
result. The next round is sent the moment the last completes (zero think time by default).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AgentWorkload:
    sessions: int = 16
    rounds: int = 4
    system_prompt_len: int = 512  # shared by every session: tool definitions
    task_len: int = 64  # per session, unique: the user's task
    tool_output_len: tuple[int, int] = (64, 256)  # new tokens appended each round
    output_len: tuple[int, int] = (16, 64)  # generated tokens per round (ignore_eos pins them)
    vocab: tuple[int, int] = (3, 4096)  # ids drawn from [lo, hi): clear of special tokens
    seed: int = 0

    def sessions_list(self) -> list[AgentSession]:
        rng = random.Random(self.seed)
        system = self._ids(rng, self.system_prompt_len)
        return [AgentSession(self, i, system, random.Random(rng.getrandbits(64)))
                for i in range(self.sessions)]

    def _ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(*self.vocab) for _ in range(n)]


@dataclass
class AgentSession:
    workload: AgentWorkload
    session_id: int
    system: list[int]
    rng: random.Random
    round: int = 0
    context: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.context = self.system + self.workload._ids(self.rng, self.workload.task_len)

    @property
    def done(self) -> bool:
        return self.round >= self.workload.rounds

    def next_request(self) -> tuple[list[int], int]:
        """Prompt ids and output length of this session's next round."""
        w = self.workload
        self.context = self.context + w._ids(self.rng, self.rng.randint(*w.tool_output_len))
        return list(self.context), self.rng.randint(*w.output_len)

    def complete(self, output_ids: list[int]) -> None:
        """Record the round's output; the next prompt extends this one with it."""
        self.context = self.context + list(output_ids)
        self.round += 1
