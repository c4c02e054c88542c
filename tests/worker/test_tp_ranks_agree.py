"""Tensor-parallel ranks agree on what each would otherwise decide alone: a copy order another rank
failed, and the sizes of the pools. A rank that disagrees refuses (or accepts) a step the others run,
and the group's collectives then pair up wrongly. The group is faked: `all_gather_object` hands each
rank's object to every rank, as torch.distributed does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from himamba.common.messages import SeqPlan, Transfer
from himamba.services.worker import tp_ranks
from himamba.services.worker.host_transfer import CopyFaults, HostTransfer, host_layout
from himamba.services.worker.memory import PoolPlan
from himamba.services.worker.pools import KVPool, KVSpec, StateComponent, StatePool, StateSpec

PS = 4


def _group(monkeypatch, others: dict[int, object], size: int = 2) -> None:
    """A group of `size` ranks where rank r (other than the caller's) contributes `others[r]`."""

    def all_gather_object(out: list, obj: object, group: object = None) -> None:
        for r in range(size):
            out[r] = others.get(r, obj)

    monkeypatch.setattr(
        tp_ranks, "dist", SimpleNamespace(get_world_size=lambda: size, all_gather_object=all_gather_object)
    )


@pytest.fixture
def copier():
    made: list[HostTransfer] = []

    def make(**faults: int) -> HostTransfer:
        kv = KVPool(KVSpec(1, 1, 2, torch.float32), 8, PS, torch.device("cpu"))
        state = StatePool(StateSpec(((StateComponent("ssm", (2,), torch.float32),),)), 4, torch.device("cpu"))
        h = HostTransfer(kv, state, host_layout(kv, state, 8, 4), torch.device("cpu"), CopyFaults(**faults))
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def _table(pages: list[int]) -> SimpleNamespace:
    p = torch.tensor(pages, dtype=torch.int64)
    return SimpleNamespace(slots=(p.view(-1, 1) * PS + torch.arange(PS)).view(-1), num_pages=len(pages))


def test_a_load_failed_on_one_rank_is_unwritten_memory_on_every_rank(copier, monkeypatch):
    orders = [Transfer(1, "h2d", [0, 1], [4, 5], [0], [2])]
    ranks = [copier(), copier(fail_at=1)]  # rank 1's copy fails, rank 0's runs
    mine = [h.run_orders(orders) for h in ranks]
    assert mine[0].done == [1] and mine[1].failed == [1]
    reader = [SeqPlan("r", 8, 1, 0, "copy", 2)]  # continues from the pages and the slot the load wrote
    for rank, h in enumerate(ranks):
        _group(monkeypatch, {r: tuple(o) for r, o in enumerate(mine) if r != rank})
        merged = tp_ranks.Fanout(rank).merge_copies(mine[rank])
        assert merged.done == [] and merged.failed == [1] and "rank 1" in merged.error
        h.unwritten.agree(orders, merged.failed)
        # Every rank refuses the batch that reads them (one rank running its forward alone would wait
        # in its first all-reduce for ranks that went on to the failure's broadcast).
        with pytest.raises(ValueError, match="never wrote"):
            h.unwritten.check_batch(reader, [_table([4, 5, 6])], PS)
        assert h.unwritten.dev_pages == {4, 5} and h.unwritten.dev_slots == {2}


def test_orders_every_rank_did_stay_written(copier, monkeypatch):
    orders = [Transfer(1, "h2d", [0], [4]), Transfer(2, "h2d", [1], [5])]
    h = copier()
    mine = h.run_orders(orders)
    _group(monkeypatch, {1: (mine.done, [2], "rank 1 broke")})
    merged = tp_ranks.Fanout(0).merge_copies(mine)
    assert merged.done == [1] and merged.failed == [2]
    h.unwritten.agree(orders, merged.failed)
    assert h.unwritten.dev_pages == {5}


def test_ranks_size_their_pools_alike_the_smallest_of_what_each_could_hold(monkeypatch):
    # Each rank plans from its own free memory (its GPU's, or the host's at its moment): left alone,
    # a page id valid on rank 0 could lie past a follower's pool and fail that rank alone.
    _group(monkeypatch, {1: PoolPlan(90, 12, 270, 36, 900)})
    agreed = tp_ranks.Fanout(0).agree_plan(PoolPlan(100, 10, 300, 30, 1000))
    assert agreed == PoolPlan(90, 10, 270, 30, 900)
