"""The front door's check of structured-output requests (ZeroMQ and HTTP alike).

Each grammar is built once against the served tokenizer (an LRU per (kind, spec)), in a thread
with the stack a build needs, so the event loop keeps serving, before its request is queued: an
invalid one is a 400. The worker is then told to build it too (`PrepareGrammar`), so the
request's first step finds it built.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import llguidance

from himamba.common.grammar import GrammarChecks, grammar_thread_pool, make_tokenizer
from himamba.common.types import GrammarSpec


class FrontDoorGrammars:
    """Checks grammars against the served tokenizer; `vocab_size` and `eos_token_ids` are read
    at the first check (the worker's WorkerInfo may have updated them by then)."""

    def __init__(
        self, tokenizer_json: Path, vocab_size: Callable[[], int], eos_token_ids: Callable[[], list[int]]
    ) -> None:
        self._path = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self.checks = GrammarChecks(self._tokenizer)
        self._pool = grammar_thread_pool("grammar-check")

    def _tokenizer(self) -> llguidance.LLTokenizer:
        return make_tokenizer(self._path.read_text(encoding="utf-8"), self._vocab_size(), self._eos())

    async def check(self, spec: GrammarSpec) -> None:
        """Raise ValueError ("grammar: why") when `spec` cannot constrain this model's output."""
        try:
            await asyncio.wrap_future(self._pool.submit(self.checks.check, spec))
        except ValueError as e:
            raise ValueError(f"grammar: {e}") from None
