"""The HybridModel contract, for every family: batching, prefix continuation, state captures and
restoring a captured state (what the prefix cache relies on), and input validation."""

from __future__ import annotations

import pytest
import torch

from himamba.services.modelgen.checkpoint import make_checkpoint
from himamba.services.worker.forward_batch import Capture, ForwardBatch
from himamba.services.worker.loader import load_model
from tests.worker.harness import Harness

ARCHS = ("nemotron_h", "granite_hybrid")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("contract")
    return {arch: load_model(make_checkpoint(arch, root / arch, preset="tiny", seed=7)) for arch in ARCHS}


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_states_close(actual: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]) -> None:
    assert len(actual) == len(expected) > 0
    for layer_a, layer_e in zip(actual, expected, strict=True):
        for name in ("conv", "ssm"):
            torch.testing.assert_close(layer_a[name], layer_e[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_eight_equals_one_by_one(models: dict, arch: str) -> None:
    model = models[arch]
    prompts = [_prompt(model.vocab_size, n, seed=i) for i, n in enumerate((1, 3, 17, 33, 64, 5, 90, 2))]
    together = Harness(model, num_pages=128).generate_greedy(prompts, 12)
    alone = [Harness(model).generate_greedy([p], 12)[0] for p in prompts]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1  # the prompts really lead to different outputs


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_in_two_parts_equals_one_prefill(models: dict, arch: str) -> None:
    model = models[arch]
    ids = _prompt(model.vocab_size, 100, seed=1)
    whole = Harness(model)
    seq_w = whole.new_sequence()
    logits_w = whole.prefill([seq_w], [ids])

    split = Harness(model, seed=5)
    seq_s = split.new_sequence()
    other = split.new_sequence()
    split.prefill([seq_s], [ids[:37]])
    # The suffix shares its batch with a fresh sequence: prefix_len > 0 and == 0 side by side.
    logits_s = split.prefill([other, seq_s], [ids[:9], ids[37:]])[1:]

    torch.testing.assert_close(logits_s, logits_w, rtol=1e-4, atol=1e-5)
    _assert_states_close(split.read_state(seq_s.state_slot), whole.read_state(seq_w.state_slot))
    tokens_w, tokens_s = [], []
    for _ in range(6):
        tokens_w.append(int(logits_w.argmax()))
        tokens_s.append(int(logits_s.argmax()))
        logits_w = whole.decode([seq_w], tokens_w[-1:])
        logits_s = split.decode([seq_s], tokens_s[-1:])
    assert tokens_s == tokens_w


@pytest.mark.parametrize("arch", ARCHS)
def test_captures_equal_the_state_of_a_prefix_prefill(models: dict, arch: str) -> None:
    model = models[arch]
    ids = _prompt(model.vocab_size, 100, seed=2)
    harness = Harness(model)
    seq, neighbour = harness.new_sequence(), harness.new_sequence()
    offsets = (1, 16, 45, 100)
    slots = {off: harness.alloc_state_slot() for off in offsets}
    harness.prefill(
        [neighbour, seq],
        [ids[:20], ids],
        captures=[[], [Capture(off, slot) for off, slot in slots.items()]],
    )
    for off in offsets:
        fresh = Harness(model)
        s = fresh.new_sequence()
        fresh.prefill([s], [ids[:off]])
        _assert_states_close(harness.read_state(slots[off]), fresh.read_state(s.state_slot))
    _assert_states_close(harness.read_state(seq.state_slot), harness.read_state(slots[100]))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_restored_capture_continues_like_a_full_prefill(models: dict, arch: str) -> None:
    """Prefix reuse: a new sequence takes another's KV pages and a captured state, then diverges."""
    model = models[arch]
    prefix = _prompt(model.vocab_size, 48, seed=3)
    harness = Harness(model, page_size=16)
    donor = harness.new_sequence()
    cached = harness.alloc_state_slot()
    harness.prefill([donor], [prefix + _prompt(model.vocab_size, 30, seed=4)], captures=[[Capture(48, cached)]])

    reuser = harness.new_sequence()
    reuser.pages = donor.pages[:3]  # positions 0..47, read only: new tokens go to fresh pages
    reuser.length = 48
    harness.copy_state(cached, reuser.state_slot)
    suffix = _prompt(model.vocab_size, 21, seed=5)
    logits = harness.prefill([reuser], [suffix])

    fresh = Harness(model)
    expected = fresh.prefill([fresh.new_sequence()], [prefix + suffix])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_sequence_ignores_what_its_slot_held(models: dict, arch: str) -> None:
    model = models[arch]
    ids = _prompt(model.vocab_size, 10, seed=6)
    clean = Harness(model)
    expected = clean.prefill([clean.new_sequence()], [ids])
    dirty = Harness(model)
    for layer in dirty.state.tensors:
        for t in layer.values():
            t.fill_(3.0)
    torch.testing.assert_close(dirty.prefill([dirty.new_sequence()], [ids]), expected)


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
