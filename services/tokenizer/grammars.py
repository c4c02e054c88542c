"""The front door's check of structured-output requests (ZeroMQ and HTTP alike).

Each grammar is built once against the served tokenizer (an LRU per (kind, spec)), in a child
process (a crash or a stall of the grammar library costs that request a 400, never the front
door), before its request is queued: an invalid one is a 400. The worker is then told to build it
too (`PrepareGrammar`, with the grammar lowered by the check: the worker does no conversion), and
the request is queued once it has (`GrammarReady`).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from himamba.common.grammar import CHECK_CACHE_SIZE, spec_key
from himamba.common.types import GrammarSpec
from himamba.services.tokenizer.grammar_process import CheckResult, GrammarCheckProcess, TokenizerSource

_NOT_AVAILABLE = "structured outputs are not available"  # a verdict on the tokenizer: not remembered
# Lowered grammars kept for the worker's PrepareGrammar (each can be as large as its spec, up to a
# MiB: fewer than verdicts). One that fell out is lowered again by the worker, in its build thread.
LOWERED_CACHE_SIZE = 32


class FrontDoorGrammars:
    """Checks grammars against the served tokenizer, in a child process (`grammar_process.py`),
    remembering the last CHECK_CACHE_SIZE verdicts; `vocab_size` and `eos_token_ids` are read at
    the first check (the worker's WorkerInfo may have updated them by then)."""

    def __init__(
        self, tokenizer_json: Path, vocab_size: Callable[[], int], eos_token_ids: Callable[[], list[int]]
    ) -> None:
        self._path = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = eos_token_ids
        self.process: GrammarCheckProcess | None = None
        self._seen: OrderedDict[bytes, str] = OrderedDict()  # spec_key -> verdict ("" when valid)
        self._lowered: OrderedDict[bytes, str] = OrderedDict()  # spec_key -> lowered grammar (valid ones)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")  # waits on the child

    def _verdict(self, spec: GrammarSpec) -> CheckResult:
        key = spec_key(spec)
        verdict = self._seen.get(key)
        if verdict is not None:
            self._seen.move_to_end(key)
            return CheckResult(verdict, self._lowered.get(key, ""))
        if self.process is None:
            self.process = GrammarCheckProcess(TokenizerSource(str(self._path), self._vocab_size(), self._eos()))
        result = self.process.check(spec)
        if not result.verdict.startswith(_NOT_AVAILABLE):
            self._seen[key] = result.verdict
            while len(self._seen) > CHECK_CACHE_SIZE:
                self._seen.popitem(last=False)
        if result.lowered:
            self._lowered[key] = result.lowered
            while len(self._lowered) > LOWERED_CACHE_SIZE:
                self._lowered.popitem(last=False)
        return result

    async def check(self, spec: GrammarSpec) -> str:
        """Raise ValueError ("grammar: why") when `spec` cannot constrain this model's output; else
        the grammar lowered to llguidance's text ("" when no longer remembered)."""
        result = await asyncio.wrap_future(self._pool.submit(self._verdict, spec))
        if result.verdict:
            raise ValueError(f"grammar: {result.verdict}")
        return result.lowered

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.process is not None:
            self.process.close()
