"""A decode batch's state rows stay out of the pool between steady decode steps
(services/worker/resident_rows.py) and are written back before anything else reads or writes the
pool: the pool always holds what it would hold had every step gathered and scattered."""

from __future__ import annotations

import torch

from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.layers.pool_rows import consecutive_rows
from himamba.services.worker.pools import StateComponent, StatePool, StateSpec

SLOTS = 10
SPEC = StateSpec(
    layers=((StateComponent("conv", (3,), torch.float32), StateComponent("ssm", (2, 2), torch.float32)),) * 2
)


def _batch(mode: str, slots: list[int]) -> ForwardBatch:
    n = len(slots)
    empty = torch.zeros(n, dtype=torch.int64)
    return ForwardBatch(
        mode=mode,  # type: ignore[arg-type]
        input_ids=empty,
        positions=empty,
        new_lens=[1] * n,
        prefix_lens=[0] * n,
        write_slots=empty,
        state_slots=torch.tensor(slots, dtype=torch.int64),
    )


def _step(pool: StatePool, ref: list[dict[str, torch.Tensor]], batch: ForwardBatch, k: float) -> None:
    """What a recurrent layer does, on `pool` through `layer()` and on `ref` directly: state of
    slot s becomes state * 2 + s + k (so order and identity of rows matter)."""
    assert batch.state_slots is not None
    add = batch.state_slots.to(torch.float32) + k
    for index in range(len(ref)):
        view, tensors = pool.layer(index, batch)
        assert view.state_slots is not None
        for name, t in tensors.items():
            rows = consecutive_rows(t, view.state_slots)
            shape = (-1,) + (1,) * (t.dim() - 1)
            if rows is not None:  # resident rows, or a pool whose slots happen to be consecutive
                rows.mul_(2).add_(add.view(shape))
            else:
                t.index_copy_(0, view.state_slots, t.index_select(0, view.state_slots) * 2 + add.view(shape))
            r = ref[index][name]
            r.index_copy_(0, batch.state_slots, r.index_select(0, batch.state_slots) * 2 + add.view(shape))


def _equal(pool: StatePool, ref: list[dict[str, torch.Tensor]]) -> bool:
    return all(torch.equal(pool.tensors[i][n], ref[i][n]) for i in range(len(ref)) for n in ref[i])


def _ref() -> list[dict[str, torch.Tensor]]:
    return [{c.name: torch.zeros((SLOTS, *c.shape)) for c in layer} for layer in SPEC.layers]


def test_steady_decode_keeps_rows_out_of_the_pool_and_writes_them_back_when_read() -> None:
    pool, ref = StatePool(SPEC, SLOTS, torch.device("cpu")), _ref()
    for k in range(3):
        _step(pool, ref, _batch("decode", [7, 2, 5]), float(k))
    raw = pool._tensors[0]["ssm"]  # the pool itself, without the write-back
    assert torch.equal(raw[7], torch.zeros(2, 2)), "steady decode should not touch the pool"
    assert _equal(pool, ref)  # `tensors` writes back first
    assert not torch.equal(raw[7], torch.zeros(2, 2))


def test_every_other_use_of_the_pool_sees_the_rows_first() -> None:
    pool, ref = StatePool(SPEC, SLOTS, torch.device("cpu")), _ref()
    _step(pool, ref, _batch("decode", [7, 2, 5]), 1.0)
    _step(pool, ref, _batch("decode", [7, 2, 5]), 2.0)
    # A state copy (a capture or a cache hit's state) reads a resident row.
    pool.copy(torch.tensor([7]), torch.tensor([9]))
    for layer in ref:
        for t in layer.values():
            t[9] = t[7]
    _step(pool, ref, _batch("decode", [7, 2, 5]), 3.0)
    # One request left and another came in (prefill, then decoding with the rest).
    _step(pool, ref, _batch("decode", [7, 5]), 4.0)
    _step(pool, ref, _batch("prefill", [1]), 5.0)
    _step(pool, ref, _batch("decode", [7, 5, 1]), 6.0)
    pool.zero(torch.tensor([5]))
    for layer in ref:
        for t in layer.values():
            t[5] = 0
    _step(pool, ref, _batch("decode", [7, 5, 1]), 7.0)
    # The same slots in another order are another batch.
    _step(pool, ref, _batch("decode", [1, 7, 5]), 8.0)
    _step(pool, ref, _batch("decode", [1, 7, 5]), 9.0)
    assert _equal(pool, ref)


def test_a_gpu_or_empty_batch_never_goes_resident() -> None:
    pool = StatePool(SPEC, SLOTS, torch.device("cpu"))
    batch = _batch("decode", [])
    view, tensors = pool.layer(0, batch)
    assert view is batch and tensors is pool._tensors[0]
