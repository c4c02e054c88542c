"""The scheduler <-> cache controller seam is typed: every op has exactly one result type, the
controller's handlers return it (for ops that succeed and ops that are refused alike), and no
signature on either side of the seam says `Any`."""

from __future__ import annotations

import inspect
import typing

import pytest

from himamba.common.config import CacheConfig
from himamba.common.messages import (
    RESULT_OF,
    Admit,
    AllocSlots,
    CacheOp,
    CacheResult,
    CancelPrefetch,
    Extend,
    FreeSlots,
    Insert,
    Prefetch,
    Release,
)
from himamba.services.cache.controller import CacheController
from himamba.services.scheduler.cache_client import CacheClient

PS = 4
TOKENS = list(range(1, 23))


def _ctrl() -> CacheController:
    return CacheController(CacheConfig(page_size=PS), num_pages=32, num_slots=8)


def _ops_for(rid: str, slot: int) -> dict[type, CacheOp]:
    """One op of each type, valid for an admitted request `rid` holding `slot`."""
    return {
        Prefetch: Prefetch(rid=rid, tokens=TOKENS),
        CancelPrefetch: CancelPrefetch(rid=rid),
        Extend: Extend(rid=rid, total_len=len(TOKENS) + 5),
        AllocSlots: AllocSlots(rid=rid, num=1),
        Insert: Insert(rid=rid, tokens=TOKENS[:8], slot=None),
        FreeSlots: FreeSlots(rid=rid, slots=[slot]),
        Release: Release(rid=rid),
    }


def test_the_op_union_and_the_result_map_agree():
    assert set(RESULT_OF) == set(typing.get_args(CacheOp))
    assert set(RESULT_OF.values()) == set(typing.get_args(CacheResult))
    assert len(set(RESULT_OF.values())) == len(RESULT_OF)  # no result type answers two ops


@pytest.mark.parametrize("op_type", typing.get_args(CacheOp), ids=lambda t: t.__name__)
def test_each_handler_returns_its_result_type_whether_the_op_succeeds_or_not(op_type):
    ctrl = _ctrl()
    admitted = ctrl.apply(Admit(rid="a", tokens=TOKENS, num_slots=2))
    assert type(admitted) is RESULT_OF[Admit] and admitted.ok
    ok_op = (
        Admit(rid="b", tokens=TOKENS, num_slots=1) if op_type is Admit else _ops_for("a", admitted.slots[1])[op_type]
    )
    res = ctrl.apply(ok_op)
    assert type(res) is RESULT_OF[op_type] and res.rid == ok_op.rid
    # The same op for a request the controller does not know: still its own result type.
    unknown = msgspec_replace(ok_op, rid="nobody")
    res = ctrl.apply(unknown)
    assert type(res) is RESULT_OF[op_type]
    for rid in ("a", "b"):
        ctrl.apply(Release(rid=rid))
    ctrl.check_invariants()
    # A whole step answers one result per op, in order.
    results = ctrl.apply_step([Admit(rid="c", tokens=TOKENS), Release(rid="c")])
    assert [type(r) for r in results] == [RESULT_OF[Admit], RESULT_OF[Release]]


def msgspec_replace(op: CacheOp, **changes: object) -> CacheOp:
    import msgspec

    return msgspec.structs.replace(op, **changes)


def _hints(fn: object) -> dict[str, object]:
    return typing.get_type_hints(fn)


@pytest.mark.parametrize(
    "fn",
    [
        CacheController.apply,
        CacheController.apply_step,
        CacheController.admit,
        CacheController.insert,
        CacheController.release,
        CacheController.free_slots,
        CacheController.attach_storage,
        CacheClient.step,
        CacheClient.admissions,
        CacheClient.predict_next,
        CacheClient.release_op,
        CacheClient._apply,
    ],
    ids=lambda f: f.__qualname__,
)
def test_no_any_in_the_seams_signatures(fn):
    hints = _hints(fn)
    assert set(hints) >= set(inspect.signature(fn).parameters) - {"self"}
    for name, hint in hints.items():
        assert "Any" not in repr(hint), f"{fn.__qualname__}: {name} is {hint!r}"
