"""The multi-turn workload of `himamba bench multiturn` (sglang's bench_multiturn, on token ids).

Each client holds a conversation. Round 1 sends a user message of `request_length` random
token ids; every later round sends the whole history (earlier prompts and the answers the
server gave) plus a new message of `sub_question_length` ids. The messages are a function of
(seed, client, round) alone, so two runs with the same seed send the same user text whatever
order the server answers in.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes of one multi-turn run."""

    num_clients: int
    num_rounds: int
    request_length: int  # tokens of the first user message
    sub_question_length: int  # tokens of each later user message
    output_length: int  # tokens asked for per round (ignore_eos: always this many)
    seed: int

    def __post_init__(self) -> None:
        for name in ("num_clients", "num_rounds", "request_length", "sub_question_length", "output_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def num_requests(self) -> int:
        return self.num_clients * self.num_rounds

    @property
    def final_prompt_len(self) -> int:
        """Prompt tokens of a conversation's last round."""
        return self.request_length + (self.num_rounds - 1) * (self.sub_question_length + self.output_length)

    @property
    def ideal_cached_ratio(self) -> float:
        """Share of all prompt tokens that repeat earlier context of the same conversation."""
        prompts = repeated = 0
        context = 0
        for r in range(self.num_rounds):
            new = self.request_length if r == 0 else self.sub_question_length
            prompts += context + new
            repeated += context
            context += new + self.output_length
        return repeated / prompts


class Turn(NamedTuple):
    """One request of one conversation."""

    client: int
    round: int  # 1-based
    input_ids: list[int]
    repeated_len: int  # leading tokens already sent or generated in this conversation


@dataclass
class Conversation:
    """One client's history; `next_turn` appends the next user message."""

    client: int
    spec: WorkloadSpec
    token_pool: Sequence[int]
    history: list[int] = field(default_factory=list)
    rounds_sent: int = 0

    @property
    def finished(self) -> bool:
        return self.rounds_sent >= self.spec.num_rounds

    def user_message(self, round_: int) -> list[int]:
        n = self.spec.request_length if round_ == 1 else self.spec.sub_question_length
        rng = random.Random(f"{self.spec.seed}:{self.client}:{round_}")
        return [self.token_pool[rng.randrange(len(self.token_pool))] for _ in range(n)]

    def next_turn(self) -> Turn:
        if self.finished:
            raise ValueError(f"conversation {self.client} has no round left (num_rounds={self.spec.num_rounds})")
        self.rounds_sent += 1
        repeated = len(self.history)
        self.history = self.history + self.user_message(self.rounds_sent)
        return Turn(self.client, self.rounds_sent, list(self.history), repeated)

    def add_answer(self, token_ids: Sequence[int]) -> None:
        self.history = self.history + list(token_ids)


def conversations(spec: WorkloadSpec, token_pool: Sequence[int]) -> list[Conversation]:
    if not token_pool:
        raise ValueError("token_pool must hold at least one token id")
    return [Conversation(c, spec, token_pool) for c in range(spec.num_clients)]


def ordinary_token_ids(model_dir: Path | str) -> list[int]:
    """The checkpoint's vocabulary less its special tokens (eos, bos, added tokens): random
    user text is drawn from these, so no message ends a conversation by accident."""
    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    special: set[int] = set()
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = cfg.get(key)
        special.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    tok = model_dir / "tokenizer.json"
    if tok.exists():
        special.update(t["id"] for t in json.loads(tok.read_text()).get("added_tokens", []))
    return [t for t in range(vocab) if t not in special]
