"""The front door's grammar checks run in a child process: no grammar can crash or stall the door.

The grammar library is native code. The limits of `common/grammar.py` bound what is known to
crash it (a chain of references overflowed its stack), but a crash we do not know of must cost one
request, not the front door. So each check (the same build the worker does, against the served
tokenizer) runs in a spawned child, one at a time:
- the child dies (a signal, an abort): the request is a 400 naming that, and a new child starts
  for the next check. The check is tried once more in the new child first, so a request that was
  merely in flight beside the crashing one is not refused for it;
- the check takes longer than GRAMMAR_CHECK_TIMEOUT_S: the child is killed, the request is a 400.
The worker builds only grammars that passed here: a build that did not crash the child does not
crash the worker (same library, same limits, a thread with the same stack). A grammar that passes
comes back lowered too (llguidance's own grammar text, what `grammar_text` converts the spec to):
that conversion is Python work holding the GIL for tens of milliseconds on a large spec (512 tools
with patterns: ~40 ms), so it is done here once, and the worker only builds the matcher from the
lowered text (native code that releases the GIL) instead of stalling its step thread with it.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import NamedTuple

from himamba.common.types import GrammarSpec

GRAMMAR_CHECK_TIMEOUT_S = 30.0  # one grammar's build and first step, at most
log = logging.getLogger("himamba.tokenizer")


class TokenizerSource(NamedTuple):
    """What the child needs to build the served tokenizer's view (as the worker builds it)."""

    tokenizer_json: str  # a path
    vocab_size: int
    eos_token_ids: list[int]


class CheckResult(NamedTuple):
    """A check's verdict ("" when the grammar can constrain the output) and, then, the grammar
    lowered to llguidance's text ("" when refused)."""

    verdict: str
    lowered: str = ""


class GrammarCheckProcess:
    """Checks grammars in a child process; `check` blocks (call it from a thread)."""

    def __init__(self, source: TokenizerSource, timeout_s: float = GRAMMAR_CHECK_TIMEOUT_S) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self.crashes = 0  # children lost to a crash or a timeout (tests and logs)
        self._lock = threading.Lock()
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None

    def check(self, spec: GrammarSpec) -> CheckResult:
        """Why `spec` cannot constrain the output ("" when it can), and its lowered text."""
        with self._lock:
            first = self._check_once(spec)
            if first is not None:
                return first
            second = self._check_once(spec)  # a fresh child: was it this grammar?
            if second is not None:
                return second
            return CheckResult("the grammar library failed building this grammar (its process crashed); it is refused")

    def _check_once(self, spec: GrammarSpec) -> CheckResult | None:
        """The verdict, or None when the child died on it."""
        conn = self._child()
        try:
            conn.send((spec.kind, spec.spec))
            if not conn.poll(self.timeout_s):
                self._lost(f"a grammar check took longer than {self.timeout_s:g}s")
                return CheckResult(f"building the grammar took longer than {self.timeout_s:g}s")
            verdict, lowered = conn.recv()
        except (EOFError, OSError):
            self._lost("the grammar check process died")
            return None
        assert isinstance(verdict, str) and isinstance(lowered, str)
        return CheckResult(verdict, lowered)

    def _child(self) -> Connection:
        if self._conn is None or self._proc is None or not self._proc.is_alive():
            ctx = multiprocessing.get_context("spawn")  # no copy of the front door's threads or sockets
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, self.source), name="grammar-check", daemon=True)
            proc.start()
            child.close()
            self._proc, self._conn = proc, parent
        return self._conn

    def _lost(self, why: str) -> None:
        self.crashes += 1
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is not None:
            proc.kill()
            proc.join()
            log.warning("%s (exit code %s); a new one starts for the next check", why, proc.exitcode)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.kill()
                self._proc.join()
            if self._conn is not None:
                self._conn.close()
            self._proc = self._conn = None


def _serve(conn: Connection, source: TokenizerSource) -> None:
    """The child: answer each (kind, spec) with its verdict until the front door goes away."""
    from pathlib import Path

    from himamba.common.grammar import GrammarChecks, grammar_text, grammar_thread_pool, make_tokenizer

    def tokenizer():
        text = Path(source.tokenizer_json).read_text(encoding="utf-8")
        return make_tokenizer(text, source.vocab_size, source.eos_token_ids)

    checks = GrammarChecks(tokenizer, size=0)  # the parent caches verdicts
    pool = grammar_thread_pool("grammar-check")  # the worker's build stack
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            return
        spec = GrammarSpec(kind=kind, spec=text)
        lowered = ""
        try:
            pool.submit(checks.check, spec).result()
            verdict = ""
            lowered = pool.submit(grammar_text, spec).result()  # what the worker then builds from
        except ValueError as e:
            verdict = str(e) or "the grammar cannot be built"
        conn.send((verdict, lowered))
