"""Seeded request mixes for load and chaos: mixed lengths on a few shared prefixes (some a whole
number of pages, some one token either side), small max_tokens so the tiny model stays fast."""

from __future__ import annotations

import random
from typing import NamedTuple

TINY_VOCAB = 2048  # the tiny demo checkpoint; id 0 is its eos
MAX_CONTEXT_LEN = 1024  # what the reliability servers are started with
PAGE = 16
PREFIX_LENS = (PAGE, PAGE + 1, 2 * PAGE - 1, 2 * PAGE, 4 * PAGE, 100, 7 * PAGE, 200)


class Prompt(NamedTuple):
    input_ids: list[int]
    max_tokens: int


def random_ids(n: int, rng: random.Random, vocab: int = TINY_VOCAB) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def mixed_prompts(n: int, seed: int, *, max_tokens: tuple[int, int] = (1, 12), max_suffix: int = 120) -> list[Prompt]:
    """`n` prompts: most extend one of a few shared prefixes (a few are exactly a prefix), the
    rest stand alone; lengths 1..~320 tokens."""
    rng = random.Random(seed)
    prefixes = [random_ids(k, rng) for k in PREFIX_LENS]
    out = []
    for _ in range(n):
        if rng.random() < 0.8:
            head = rng.choice(prefixes)
            tail = random_ids(rng.choice([0, rng.randint(1, max_suffix)]), rng)
        else:
            head, tail = [], random_ids(rng.randint(1, max_suffix), rng)
        out.append(Prompt(head + tail, rng.randint(*max_tokens)))
    return out
