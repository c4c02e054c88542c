"""The reconnect gate: fail fast while a store is away, one probe per backoff, doubling backoff."""

from __future__ import annotations

import threading

import pytest

from himamba.services.cache.storage.base import StorageCounters
from himamba.services.cache.storage.reconnect import ReconnectGate, StoreLink


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_closed_gate_admits_everyone() -> None:
    gate = ReconnectGate(1.0, 8.0, clock=_Clock())
    assert all(gate.admit() for _ in range(5))
    assert not gate.succeeded()  # nothing was open
    assert gate.state() == (False, 0, 0.0)


def test_failure_opens_then_one_probe_per_backoff_and_backoff_doubles() -> None:
    clock = _Clock()
    gate = ReconnectGate(1.0, 4.0, jitter=0.0, clock=clock)
    assert gate.admit()
    assert gate.failed()  # it just went away
    assert not gate.admit()
    clock.now += 0.99
    assert not gate.admit()
    clock.now += 0.02
    assert gate.admit()  # the probe
    assert not gate.admit()  # only one at a time
    assert not gate.failed()  # still away: not a new outage
    assert gate.state().consecutive_failures == 2
    assert gate.state().retry_in_s == pytest.approx(2.0)
    clock.now += 2.0
    assert gate.admit()
    gate.failed()
    assert gate.state().retry_in_s == pytest.approx(4.0)
    clock.now += 4.0
    assert gate.admit()
    gate.failed()
    assert gate.state().retry_in_s == pytest.approx(4.0)  # capped
    clock.now += 4.0
    assert gate.admit()
    assert gate.succeeded()  # it came back
    assert gate.admit() and gate.admit()
    assert gate.state() == (False, 0, 0.0)


def test_an_abandoned_probe_frees_its_slot() -> None:
    clock = _Clock()
    gate = ReconnectGate(1.0, 1.0, jitter=0.0, clock=clock)
    gate.failed()
    clock.now += 1.0
    assert gate.admit()
    gate.abandon()
    assert gate.admit()  # another caller may probe
    assert gate.state().is_open


def test_jitter_stays_within_its_band() -> None:
    clock = _Clock()
    gate = ReconnectGate(10.0, 10.0, jitter=0.2, seed=3, clock=clock)
    waits = []
    for _ in range(50):
        gate.failed()
        waits.append(gate.state().retry_in_s)
    assert all(8.0 <= w <= 12.0 for w in waits)
    assert len({round(w, 6) for w in waits}) > 1


def test_only_one_of_many_threads_probes() -> None:
    clock = _Clock()
    gate = ReconnectGate(1.0, 1.0, jitter=0.0, clock=clock)
    gate.failed()
    clock.now += 1.0
    admitted: list[bool] = []
    barrier = threading.Barrier(8)

    def call() -> None:
        barrier.wait()
        admitted.append(gate.admit())

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(admitted) == [False] * 7 + [True]


def test_store_link_counts_errors_and_reconnects() -> None:
    clock = _Clock()
    counters = StorageCounters()
    link = StoreLink("test store", counters, ReconnectGate(1.0, 1.0, jitter=0.0, clock=clock))
    assert link.admit()
    link.lost("connection refused")
    assert not link.admit() and not link.admit()  # failing fast, counted
    clock.now += 1.0
    assert link.admit()
    link.reached()
    s = counters.snapshot()
    assert (s.num_errors, s.num_reconnects) == (3, 1)


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="base_s"):
        ReconnectGate(0.0)
    with pytest.raises(ValueError, match="max_s"):
        ReconnectGate(2.0, 1.0)
    with pytest.raises(ValueError, match="jitter"):
        ReconnectGate(1.0, 2.0, jitter=1.5)
