"""The front door's grammar checks in a child process: a verdict per grammar, and a child that
dies or stalls costs one check (refused, or retried in a new child), never the caller."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from himamba.common.grammar import grammar_text
from himamba.common.types import GrammarSpec
from himamba.services.tokenizer.grammar_process import GrammarCheckProcess, TokenizerSource
from tests.worker.test_grammar_masks import EOS, _tiny_tokenizer

# About 2 s to build: time enough to kill the child during it.
SLOW = GrammarSpec(
    kind="json_schema",
    spec=json.dumps(
        {
            "type": "object",
            "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)},
            "required": [f"p{i}" for i in range(10_000)],
        }
    ),
)


@pytest.fixture
def checker(tmp_path: Path) -> Iterator[GrammarCheckProcess]:
    tok = _tiny_tokenizer()
    path = tmp_path / "tokenizer.json"
    path.write_text(tok.to_str(), encoding="utf-8")
    c = GrammarCheckProcess(TokenizerSource(str(path), tok.get_vocab_size(), [EOS]))
    yield c
    c.close()


def test_verdicts_come_from_the_child(checker: GrammarCheckProcess) -> None:
    ok = checker.check(GrammarSpec(kind="regex", spec="[ab]+"))
    assert ok.verdict == "" and ok.lowered == grammar_text(GrammarSpec(kind="regex", spec="[ab]+"))
    refused = checker.check(GrammarSpec(kind="regex", spec="a(b"))
    assert refused.verdict and refused.lowered == ""  # the library's reason; nothing to build
    assert "more than 1000" in checker.check(
        GrammarSpec(kind="choice", spec=json.dumps([f"c{i}" for i in range(2000)]))
    ).verdict
    assert checker.crashes == 0


def test_a_child_that_dies_mid_check_is_replaced_and_the_check_retried(checker: GrammarCheckProcess) -> None:
    assert checker.check(GrammarSpec(kind="regex", spec="x")).verdict == ""  # the child is up
    assert checker._proc is not None
    victim = checker._proc.pid

    def crash_it() -> None:
        time.sleep(0.3)  # inside the slow build
        os.kill(victim, signal.SIGSEGV)

    threading.Thread(target=crash_it).start()
    assert checker.check(SLOW).verdict == ""  # a crash beside a check is not that check's fault: retried
    assert checker.crashes == 1 and checker._proc is not None and checker._proc.pid != victim
    assert checker.check(GrammarSpec(kind="regex", spec="y")).verdict == ""


def test_a_check_over_its_time_is_refused_and_the_child_replaced(checker: GrammarCheckProcess) -> None:
    checker.timeout_s = 0.2
    assert "took longer than 0.2s" in checker.check(SLOW).verdict
    assert checker.crashes == 1
    checker.timeout_s = 60
    assert checker.check(GrammarSpec(kind="regex", spec="z")).verdict == ""
