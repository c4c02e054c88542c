"""Decode updates recurrent states in the pool itself when a batch's slots are consecutive, and
through gathered copies otherwise: both paths must give the same tokens, bit for bit. On the CUDA
path the kernels take the whole pool and the batch's slots and update the pool rows in place: no
gathered copy, no scatter, the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from himamba.kernels.dispatch import CUDA_PATH_ENV
from himamba.services.worker import pools
from himamba.services.worker.layers import pool_rows
from himamba.services.worker.layers.pool_rows import consecutive_rows, decode_rows
from himamba.services.worker.loader import load_model
from tests.worker.harness import Harness, Sequence
from tests.worker.hf_reference import save_nemotron_h, save_tiny


def test_consecutive_rows_is_a_view_of_the_pool() -> None:
    pool = torch.zeros(8, 3)
    rows = consecutive_rows(pool, torch.tensor([2, 3, 4]))
    assert rows is not None and rows.shape == (3, 3)
    rows.add_(1.0)
    assert pool[2:5].eq(1.0).all() and pool[:2].eq(0.0).all() and pool[5:].eq(0.0).all()
    single = consecutive_rows(pool, torch.tensor([7]))
    assert single is not None and single.data_ptr() == pool[7].data_ptr()


@pytest.mark.parametrize("slots", [[3, 2], [1, 3], [4, 4]])
def test_consecutive_rows_refuses_other_slot_orders(slots: list[int]) -> None:
    assert consecutive_rows(torch.zeros(8, 3), torch.tensor(slots)) is None


def test_consecutive_rows_refuses_an_empty_batch() -> None:
    assert consecutive_rows(torch.zeros(8, 3), torch.tensor([], dtype=torch.int64)) is None


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return load_model(save_nemotron_h(Path(tmp_path_factory.mktemp("nemotron_h")) / "hf"))


def _generate(model, slots: list[int], prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill the prompts with sequences on the given state slots, then decode greedily; the
    logits of every step."""
    harness = Harness(model, num_state_slots=16)
    seqs = [Sequence(state_slot=s) for s in slots]
    logits = harness.prefill(seqs, prompts)
    out = [logits]
    for _ in range(steps):
        logits = harness.decode(seqs, logits.argmax(-1).tolist())
        out.append(logits)
    return out


@pytest.mark.parametrize(
    ("in_place", "gathered"),
    [([5, 6, 7], [9, 2, 12]), ([0, 1], [1, 0])],
    ids=["three-sequences", "swapped-pair"],
)
def test_in_place_and_gathered_state_updates_agree(model, in_place: list[int], gathered: list[int]) -> None:
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(len(in_place))]
    a = _generate(model, in_place, prompts, steps=6)
    b = _generate(model, gathered, prompts, steps=6)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(x, y), f"step {step}"


def test_decode_rows_on_the_cuda_path_is_the_pool_and_its_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, slots = torch.zeros(8, 3), torch.tensor([2, 3, 4])
    assert decode_rows(pool, slots).indices is None  # CPU: a view of consecutive rows
    monkeypatch.setenv(CUDA_PATH_ENV, "1")
    rows = decode_rows(pool, slots)
    assert rows.state is pool and rows.indices is slots and not rows.gathered


# One family per recurrent decode update: Mamba2 (conv + SSD), Mamba1, the gated delta rule, the short conv.
CUDA_PATH_FAMILIES = ["NemotronH", "Jamba", "Qwen3Next", "Lfm2"]


@pytest.mark.parametrize("architecture", CUDA_PATH_FAMILIES)
def test_the_cuda_path_updates_pool_rows_in_place_with_no_copies(
    architecture: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = load_model(save_tiny(architecture, tmp_path / "hf"))
    slots = [9, 2, 12]  # neither consecutive nor ordered: the CPU path gathers and scatters these
    prompts = [[(5 * i + 3 * j) % 400 + 1 for j in range(4 + 7 * i)] for i in range(len(slots))]
    cpu = _generate(tiny, slots, prompts, steps=4)

    def no_copy(*args: object) -> None:
        raise AssertionError("the CUDA decode path gathered or scattered state rows")

    monkeypatch.setenv(CUDA_PATH_ENV, "1")
    monkeypatch.setattr(pool_rows, "gather_state_rows", no_copy)
    monkeypatch.setattr(pool_rows, "scatter_state_rows", no_copy)
    # Nor the CPU path's views of consecutive rows, nor its resident rows (gathered copies kept
    # between steps): the kernels get the pool itself and the slots.
    monkeypatch.setattr(pool_rows, "consecutive_rows", no_copy)
    monkeypatch.setattr(pools, "ResidentRows", no_copy)
    cuda = _generate(tiny, slots, prompts, steps=4)
    for step, (x, y) in enumerate(zip(cpu, cuda, strict=True)):
        # The CPU path runs the native kernels on gathered rows, the CUDA path the references on the
        # pool by index: the same arithmetic up to float32 rounding.
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4, msg=f"step {step}")
