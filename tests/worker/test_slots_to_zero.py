"""Which state slots the worker zeroes before a forward (services/worker/runner.py `slots_to_zero`).

That a fresh prefill may skip it is checked per family by `assert_fresh_sequence_ignores_its_slot`
(tests/worker/family_checks.py): a slot full of other values gives the same prefill and next decode."""

from __future__ import annotations

from himamba.common.messages import SeqPlan
from himamba.services.worker.runner import slots_to_zero


def _seq(slot: int, prefix_len: int, init: str, new_len: int = 4) -> SeqPlan:
    return SeqPlan(f"r{slot}", prefix_len, new_len, slot, init)  # type: ignore[arg-type]


def test_a_fresh_prefill_keeps_its_slot_unzeroed_and_the_rest_are_zeroed() -> None:
    seqs = [_seq(1, 0, "zero"), _seq(2, 16, "zero"), _seq(3, 0, "keep"), _seq(4, 16, "copy"), _seq(5, 8, "keep")]
    # Only the sequence that starts from zeros after a prefix (no state came with it) is zeroed.
    assert slots_to_zero("prefill", seqs) == [2]
    # A fresh sequence with no token in this batch writes nothing: its slot is zeroed.
    assert slots_to_zero("prefill", [_seq(6, 0, "zero", new_len=0)]) == [6]


def test_outside_a_prefill_every_zero_slot_is_zeroed() -> None:
    seqs = [_seq(1, 0, "zero"), _seq(2, 16, "zero"), _seq(3, 16, "keep")]
    assert slots_to_zero("decode", seqs) == [1, 2]
    assert slots_to_zero("none", seqs) == [1, 2]
