"""Random prompts (token ids) for servers under test, the same for the same seed."""

from __future__ import annotations

import random

TINY_VOCAB = 2048  # the vocabulary of make_checkpoint's "tiny" preset


def random_tokens(n: int, seed: int, vocab: int = TINY_VOCAB) -> list[int]:
    """`n` token ids in [1, vocab): id 0 (end of text) would stop a generation early."""
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]
