"""The worker's copy path when orders fail: every order ends exactly once (done or failed), the
orders after a failed one in the same batch fail without running, and nothing (a later copy or a
forward) may read memory a failed order never wrote until something writes it again."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from himamba.common.messages import SeqPlan, Transfer
from himamba.services.worker.host_transfer import CopyFaults, HostTransfer, host_layout
from himamba.services.worker.pools import KVPool, KVSpec, StateComponent, StatePool, StateSpec

PS = 4


@pytest.fixture
def copier():
    kv = KVPool(KVSpec(1, 1, 2, torch.float32), 8, PS, torch.device("cpu"))
    state = StatePool(StateSpec(((StateComponent("ssm", (2,), torch.float32),),)), 4, torch.device("cpu"))
    made: list[HostTransfer] = []

    def make(**faults: int) -> HostTransfer:
        h = HostTransfer(kv, state, host_layout(kv, state, 8, 4), torch.device("cpu"), CopyFaults(**faults))
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def _table(pages: list[int]) -> SimpleNamespace:
    """A worker page table (services/worker/page_tables.py SeqState): token slots and a page count."""
    p = torch.tensor(pages, dtype=torch.int64)
    return SimpleNamespace(slots=(p.view(-1, 1) * PS + torch.arange(PS)).view(-1), num_pages=len(pages))


def test_every_order_ends_once_and_orders_after_a_failure_do_not_run(copier):
    h = copier(fail_at=2)
    h.kv.k[0].fill_(7.0)
    orders = [
        Transfer(1, "d2h", [0], [0]),
        Transfer(2, "h2d", [1], [2], [1], [1]),
        Transfer(3, "d2h", [3], [3]),
    ]
    out = h.run_orders(orders)
    assert out.done == [1] and out.failed == [2, 3] and "debug.transfer_fail_at" in out.error
    assert h.host.kv is not None and float(h.host.kv[3].abs().sum()) == 0.0, "an order after the failure ran"
    assert h.unwritten.dev_pages == {2} and h.unwritten.dev_slots == {1} and h.unwritten.host_pages == {3}


def test_nothing_reads_what_a_failed_order_never_wrote_until_it_is_written(copier):
    h = copier(fail_at=1)
    assert h.run_orders([Transfer(1, "h2d", [0, 1], [4, 5], [0], [2])]).failed == [1]
    # A backup of the unwritten pages fails instead of copying garbage to host.
    out = h.run_orders([Transfer(2, "d2h", [5], [6])])
    assert out.failed == [2] and "never wrote" in out.error
    # A forward continuing from them fails the batch.
    reader = [SeqPlan("r", 8, 1, 0, "copy", 2)]
    with pytest.raises(ValueError, match="never wrote"):
        h.unwritten.check_batch(reader, [_table([4, 5, 6])], PS)
    # A fresh prefill writes page 4 and slot 2 (as its working slot): both are clean afterwards.
    writer = [SeqPlan("w", 0, 4, 2, "zero")]
    h.unwritten.check_batch(writer, [_table([4])], PS)
    h.unwritten.batch_ran(writer, [_table([4])], PS)
    assert h.unwritten.dev_pages == {5} and 2 not in h.unwritten.dev_slots
    # A successful load into page 5 cleans it too.
    assert h.run_orders([Transfer(3, "h2d", [0], [5])]).done == [3]
    assert not h.unwritten.dev_pages


def test_the_batch_fault_fails_the_batch_carrying_the_order_after_its_copies_ran(copier):
    h = copier(batch_fail_at=2)
    out = h.run_orders([Transfer(1, "d2h", [0], [0]), Transfer(2, "d2h", [1], [1])])
    assert out.done == [1, 2] and not out.failed and h.faults.fail_batch


def test_the_exit_hook_dies_mid_order_once_per_instance(copier, tmp_path):
    """The worker dies during its Nth order (KV copied, states not); a restarted worker with the
    same settings finds the marker and does not die again."""
    import os

    marker = tmp_path / "debug-worker-exit.fired"
    h = copier()  # made (and removed) here: a child that dies cannot unlink its host pools

    def incarnation() -> int:
        pid = os.fork()
        if pid == 0:  # the child: a worker's copy path with the hook
            code = 0
            try:
                h.faults = CopyFaults(exit_at=2, exit_marker=marker)
                out = h.run_orders([Transfer(1, "d2h", [0], [0]), Transfer(2, "d2h", [1], [1], [0], [0])])
                code = 0 if out.done == [1, 2] else 3
            except BaseException:  # noqa: BLE001 - a child must never return into pytest
                code = 4
            finally:
                os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    assert incarnation() == 70 and marker.exists()
    assert incarnation() == 0  # restarted with the same settings: the hook is spent


def test_host_runs_group_consecutive_host_ids_in_order():
    from himamba.services.worker.host_transfer import host_runs

    assert host_runs([]) == []
    assert host_runs([4, 5, 6]) == [(0, 4, 3)]
    assert host_runs([7, 2, 3, 9, 10, 4]) == [(0, 7, 1), (1, 2, 2), (3, 9, 2), (5, 4, 1)]
    assert host_runs([3, 2]) == [(0, 3, 1), (1, 2, 1)]  # descending ids are separate runs
