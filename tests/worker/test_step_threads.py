"""StepThreads: the per-step thread plan learns which candidate is fastest for each step size."""

from __future__ import annotations

import itertools

import pytest
import torch

from himamba.services.worker.step_threads import LEARN_MAX_TOKENS, Plan, StepThreads, threads_for

FULL, ONE_HEAD_ALL, ONE = Plan(4, 4), Plan(1, 4), Plan(1, 1)


def _run(choice: StepThreads, tokens: int, steps: int, seconds: dict[Plan, float]) -> list[Plan]:
    picked = []
    for _ in range(steps):
        plan = choice.pick(tokens)
        picked.append(plan)
        choice.record(tokens, plan, seconds[plan])
    return picked


def test_candidates_are_all_threads_one_thread_with_the_head_on_all_and_one_thread() -> None:
    assert StepThreads(4).candidates == (FULL, ONE_HEAD_ALL, ONE)
    assert StepThreads(1).candidates == (Plan(1, 1),)


def test_learns_the_fastest_candidate_per_group_and_keeps_exploring_the_others_in_turn() -> None:
    choice = StepThreads(4, explore_every=8)
    head_fast = _run(choice, 1, 170, {FULL: 0.008, ONE_HEAD_ALL: 0.005, ONE: 0.006})
    assert head_fast[:9] == [FULL] * 3 + [ONE_HEAD_ALL] * 3 + [ONE] * 3  # three samples of each first
    settled = head_fast[9:]
    explored = len(settled) // 8  # every 8th step retries another candidate, each in turn
    assert settled.count(ONE_HEAD_ALL) == len(settled) - explored
    assert settled.count(FULL) + settled.count(ONE) == explored
    assert abs(settled.count(FULL) - settled.count(ONE)) <= 1
    # Another size class learns on its own: here all threads win.
    many_fast = _run(choice, 12, 60, {FULL: 0.010, ONE_HEAD_ALL: 0.019, ONE: 0.020})
    assert many_fast[9:].count(FULL) > len(many_fast[9:]) // 2
    assert choice.choices() == {1: ONE_HEAD_ALL, 15: FULL}


def test_follows_a_change_of_the_fastest_candidate_and_says_so_at_each_change() -> None:
    choice = StepThreads(2, explore_every=4)
    full, head, one = choice.candidates
    changes = []

    def run(steps: int, seconds: dict[Plan, float]) -> None:
        for _ in range(steps):
            plan = choice.pick(8)
            change = choice.record(8, plan, seconds[plan])
            if change is not None:
                changes.append(change)

    run(40, {full: 0.006, head: 0.005, one: 0.004})
    assert choice.choices() == {15: one}
    run(300, {full: 0.006, head: 0.009, one: 0.009})  # the machine got busy: one thread now loses
    assert choice.choices() == {15: full}
    # Stale means of the rarely retried candidates may win for a while on the way: each change is told once.
    assert (changes[0].low, changes[0].high, changes[0].plan, changes[0].first) == (8, 15, one, True)
    assert changes[-1].plan == full and not any(c.first for c in changes[1:])
    assert all(a.plan != b.plan for a, b in itertools.pairwise(changes))
    assert "steps of 8-15 tokens now run on 2 thread(s) (2 thread(s) 6.00 ms" in changes[-1].describe()
    assert "1 thread(s), head on 2 " in changes[-1].describe()


def test_large_steps_and_a_single_thread_never_learn() -> None:
    choice = StepThreads(2)
    assert {choice.pick(LEARN_MAX_TOKENS + 1) for _ in range(10)} == {Plan(2, 2)}
    choice.record(LEARN_MAX_TOKENS + 1, Plan(1, 1), 0.001)
    assert choice.choices() == {}
    single = StepThreads(1)
    assert {single.pick(1) for _ in range(10)} == {Plan(1, 1)}


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        StepThreads(0)
    with pytest.raises(ValueError):
        StepThreads(2, explore_every=1)


def test_a_step_runs_on_the_picked_threads_and_gives_every_thread_back() -> None:
    before = torch.get_num_threads()
    choices = []
    steps = StepThreads(2, on_choice=choices.append)
    seen = []
    try:
        for _ in range(9):  # three samples of each candidate, in order
            with steps.step(1) as plan:
                seen.append((torch.get_num_threads(), plan.head_threads))
            assert torch.get_num_threads() == 2
        assert seen == [(2, 2)] * 3 + [(1, 2)] * 3 + [(1, 1)] * 3
        # The class's first pick was announced (empty steps time alike: later flips may follow).
        assert choices and choices[0].first and not any(c.first for c in choices[1:])
        with pytest.raises(RuntimeError), steps.step(1):
            raise RuntimeError("the forward failed")
        assert torch.get_num_threads() == 2  # given back after a failed step too
    finally:
        torch.set_num_threads(before)


def test_threads_for_runs_the_body_on_that_count_and_restores_it() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with threads_for(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with pytest.raises(RuntimeError), threads_for(2):
            raise RuntimeError("the head failed")
        assert torch.get_num_threads() == 1
        with threads_for(None):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
