"""StepThreads: the per-step thread choice learns which candidate is faster for each step size."""

from __future__ import annotations

import pytest

from himamba.services.worker.step_threads import LEARN_MAX_TOKENS, StepThreads


def _run(choice: StepThreads, tokens: int, steps: int, seconds: dict[int, float]) -> list[int]:
    picked = []
    for _ in range(steps):
        threads = choice.pick(tokens)
        picked.append(threads)
        choice.record(tokens, threads, seconds[threads])
    return picked


def test_learns_the_faster_candidate_per_group_and_keeps_exploring() -> None:
    choice = StepThreads(4, explore_every=8)
    one_fast = _run(choice, 1, 80, {1: 0.005, 4: 0.008})
    assert one_fast[:6] == [4, 4, 4, 1, 1, 1]  # three samples of each candidate first
    settled = one_fast[6:]
    assert settled.count(4) == len(settled) // 8  # the slower one is retried every 8th step
    assert settled.count(1) == len(settled) - len(settled) // 8
    # Another size class learns on its own: here all threads win.
    many_fast = _run(choice, 12, 40, {1: 0.020, 4: 0.010})
    assert many_fast[6:].count(4) > many_fast[6:].count(1)
    assert choice.choices() == {1: 1, 15: 4}


def test_follows_a_change_of_the_faster_candidate_and_says_so_once_per_change() -> None:
    choice = StepThreads(2, explore_every=4)
    changes = []

    def run(steps: int, seconds: dict[int, float]) -> None:
        for _ in range(steps):
            threads = choice.pick(8)
            change = choice.record(8, threads, seconds[threads])
            if change is not None:
                changes.append(change)

    run(40, {1: 0.004, 2: 0.006})
    assert choice.choices() == {15: 1}
    run(200, {1: 0.009, 2: 0.006})  # the machine got busy: one thread now loses
    assert choice.choices() == {15: 2}
    assert [(c.low, c.high, c.threads, c.first) for c in changes] == [(8, 15, 1, True), (8, 15, 2, False)]
    assert "steps of 8-15 tokens now run on 2 thread(s)" in changes[-1].describe()


def test_large_steps_and_a_single_thread_never_learn() -> None:
    choice = StepThreads(2)
    assert {choice.pick(LEARN_MAX_TOKENS + 1) for _ in range(10)} == {2}
    choice.record(LEARN_MAX_TOKENS + 1, 1, 0.001)
    assert choice.choices() == {}
    single = StepThreads(1)
    assert {single.pick(1) for _ in range(10)} == {1}


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        StepThreads(0)
    with pytest.raises(ValueError):
        StepThreads(2, explore_every=1)


def test_a_step_runs_on_the_picked_threads_and_gives_every_thread_back() -> None:
    import torch

    before = torch.get_num_threads()
    choices = []
    steps = StepThreads(2, on_choice=choices.append)
    seen = []
    try:
        for _ in range(6):  # three samples of each candidate: 2 threads first, then 1
            with steps.step(1):
                seen.append(torch.get_num_threads())
            assert torch.get_num_threads() == 2
        assert seen == [2, 2, 2, 1, 1, 1]
        # The class's first pick was announced (empty steps time alike: later flips may follow).
        assert choices and choices[0].first and not any(c.first for c in choices[1:])
        with pytest.raises(RuntimeError), steps.step(1):
            raise RuntimeError("the forward failed")
        assert torch.get_num_threads() == 2  # given back after a failed step too
    finally:
        torch.set_num_threads(before)
