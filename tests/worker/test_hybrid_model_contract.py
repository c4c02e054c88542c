"""The HybridModel contract, for every family: batching, prefix continuation, state captures and
restoring a captured state (what the prefix cache relies on), and input validation."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

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
