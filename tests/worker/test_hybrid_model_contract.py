"""The HybridModel contract, for every family: batching, prefix continuation, state captures and
restoring a captured state (what the prefix cache relies on), and input validation."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from himamba.kernels import dispatch
from himamba.services.modelgen.checkpoint import ARCHS as ALL_ARCHS
from himamba.services.modelgen.checkpoint import make_checkpoint
from himamba.services.worker.forward_batch import Capture, ForwardBatch
from himamba.services.worker.loader import load_model
from himamba.services.worker.models.base import HybridModel
from tests.worker import family_checks as checks
from tests.worker.harness import Harness

ARCHS = ("nemotron_h", "granite_hybrid")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("contract")
    return {arch: load_model(make_checkpoint(arch, root / arch, preset="tiny", seed=7)) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("check", checks.CACHE_CHECKS, ids=lambda c: c.__name__.removeprefix("assert_"))
def test_cache_behaviour(models: dict, arch: str, check: Callable[[HybridModel], None]) -> None:
    """Batching, prefix continuation, state captures, restoring a captured state (device and host tier)."""
    check(models[arch])


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_captures_on_the_reference_path(
    arch: str, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each family's captures equal prefills of exactly that prefix with the PyTorch references (the
    segment loop) too; the parity suites check them on the native varlen kernels."""
    model = load_model(make_checkpoint(arch, tmp_path_factory.mktemp(arch), preset="tiny", seed=7))
    monkeypatch.setenv(dispatch.KERNELS_ENV, "reference")
    dispatch.kernels_mode.cache_clear()
    try:
        checks.assert_captures_equal_prefix_prefills(model)
    finally:
        monkeypatch.undo()
        dispatch.kernels_mode.cache_clear()


def _one_token_prefill(harness: Harness) -> ForwardBatch:
    seq = harness.new_sequence()
    return ForwardBatch(
        mode="prefill",
        input_ids=torch.tensor([5]),
        positions=torch.tensor([0]),
        new_lens=[1],
        prefix_lens=[0],
        write_slots=torch.tensor(harness.token_slots(seq, 0, 1)),
        seq_slots=[torch.tensor(harness.token_slots(seq, 0, 1))],
        state_slots=torch.tensor([seq.state_slot]),
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("captures", [[Capture(0, 1)]], "captures"),
        ("captures", [[Capture(1, 10_000)]], "captures"),
        ("state_slots", None, "state_slots"),
        ("new_lens", [2], "input_ids"),
        ("mode", "verify", "mode"),
    ],
)
def test_malformed_batches_are_rejected(models: dict, field: str, value: object, message: str) -> None:
    harness = Harness(models["nemotron_h"])
    batch = _one_token_prefill(harness)
    setattr(batch, field, value)
    with pytest.raises(ValueError, match=message):
        models["nemotron_h"].forward(batch, harness.kv, harness.state)


def test_the_vocabulary_head_runs_on_the_batchs_head_threads(models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-thread step may run its head on more threads (worker/step_threads.py): the head sees
    that count, the layers and the caller keep theirs, and the logits are the same."""
    model = models["nemotron_h"]
    seen: list[tuple[str, int]] = []
    head_forward, layer_step = type(model.lm_head).forward, type(model.stack.layers[0]).step

    def head(self, hidden):  # type: ignore[no-untyped-def]
        seen.append(("head", torch.get_num_threads()))
        return head_forward(self, hidden)

    def layer(self, *args):  # type: ignore[no-untyped-def]
        seen.append(("layer", torch.get_num_threads()))
        return layer_step(self, *args)

    monkeypatch.setattr(type(model.lm_head), "forward", head)
    monkeypatch.setattr(type(model.stack.layers[0]), "step", layer)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        harness = Harness(model)
        plain = model.forward(_one_token_prefill(harness), harness.kv, harness.state)
        seen.clear()
        harness = Harness(model)
        batch = _one_token_prefill(harness)
        batch.head_threads = 2
        wide = model.forward(batch, harness.kv, harness.state)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert {t for kind, t in seen if kind == "layer"} == {1}
    assert [t for kind, t in seen if kind == "head"] == [2]
    torch.testing.assert_close(wide, plain, rtol=1e-6, atol=1e-6)
