"""Chaos: while "keeper" requests run, "victims" on the same shared prefixes are aborted at
random points or lose their client mid-stream (see chaos_wave). The server stays up, every
keeper's answer equals the no-cache reference (also when run again on whatever the victims left
in the cache), and after the drain nothing is left in the pools."""

from __future__ import annotations

import asyncio
import random
from typing import NamedTuple

import pytest

from himamba.common.messages import CacheStats
from himamba.common.types import FinishReason
from tests.reliability.chaos_wave import NUM_VICTIMS, keep, run_wave
from tests.reliability.pools import assert_nothing_leaked, wait_drained
from tests.reliability.prompts import Prompt, mixed_prompts

KEEPERS = 32


class ChaosRun(NamedTuple):
    keepers: list[Prompt]
    keeper_tokens: list[list[int]]  # first pass, beside the victims
    rerun_tokens: list[list[int]]  # second pass, on what the first left in the cache
    abort_reasons: list[FinishReason | None]  # victims aborted with client.abort
    server_alive: bool
    after: list[int]  # tokens of a fresh request after the chaos
    stats: CacheStats
    new_log: str


@pytest.fixture(scope="module")
def chaos_run(served, soak_scale) -> ChaosRun:
    log_start = len(served.main.log())
    rng = random.Random(7)
    keeper_tokens: list[list[int]] = []
    abort_reasons: list = []
    keepers: list[Prompt] = []
    for wave in range(soak_scale.chaos_waves):
        # One draw, so victims and keepers share the same prefixes.
        mix = mixed_prompts(KEEPERS + NUM_VICTIMS, seed=500 + wave, max_tokens=(4, 16))
        wave_keepers, victims = mix[:KEEPERS], mix[KEEPERS:]
        got, reasons = asyncio.run(run_wave(served, wave_keepers, victims, rng))
        keepers += wave_keepers
        keeper_tokens += got
        abort_reasons += reasons
    rerun = asyncio.run(keep(served.main.endpoint, keepers))
    alive = served.main.proc.poll() is None
    after = asyncio.run(keep(served.main.endpoint, [Prompt([5, 6, 7, 8], 3)]))[0] if alive else []
    stats = wait_drained(served.main)
    return ChaosRun(keepers, keeper_tokens, rerun, abort_reasons, alive, after, stats, served.main.log()[log_start:])


def test_server_stays_up_and_serves_after_the_chaos(chaos_run):
    assert chaos_run.server_alive
    assert len(chaos_run.after) == 3


def test_keepers_equal_the_reference_beside_the_victims(chaos_run, reference_tokens):
    want = reference_tokens([(p.input_ids, p.max_tokens) for p in chaos_run.keepers])
    wrong = [i for i, (g, w) in enumerate(zip(chaos_run.keeper_tokens, want, strict=True)) if g != w]
    assert not wrong, f"{len(wrong)} of {len(want)} keepers differ from the reference"


def test_keepers_rerun_on_the_victims_cache_equal_the_reference(chaos_run, reference_tokens):
    want = reference_tokens([(p.input_ids, p.max_tokens) for p in chaos_run.keepers])
    wrong = [i for i, (g, w) in enumerate(zip(chaos_run.rerun_tokens, want, strict=True)) if g != w]
    assert not wrong, f"{len(wrong)} of {len(want)} re-run keepers differ from the reference"


def test_aborted_requests_end_with_finish_reason_abort(chaos_run):
    assert chaos_run.abort_reasons and all(r == "abort" for r in chaos_run.abort_reasons), chaos_run.abort_reasons


def test_nothing_leaks_after_the_chaos(chaos_run):
    assert_nothing_leaked(chaos_run.stats)


def test_no_service_logged_an_error_during_the_chaos(chaos_run):
    errors = [line for line in chaos_run.new_log.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not errors, "\n".join(errors[:20])
