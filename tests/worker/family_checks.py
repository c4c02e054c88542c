"""Checks shared by the family tests: parity with transformers, batching, and the prefix-cache
behaviours every family must have (split prefill, captures, restored captures, host-tier copies).

Each family's test file builds its checkpoints with `family_checkpoints` and takes the tests every
family runs from `prefill_parity_test`, `greedy_parity_test` and `cache_behaviour_test`. States are
compared component by component, whatever the layer kind names them ("conv", "ssm", "recurrent").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from himamba.common.host_layout import HostPoolLayout
from himamba.common.messages import Transfer
from himamba.services.modelgen.checkpoint import make_checkpoint
from himamba.services.worker.forward_batch import Capture
from himamba.services.worker.host_transfer import HostTransfer, host_layout
from himamba.services.worker.loader import load_model
from himamba.services.worker.models.base import HybridModel
from tests.worker.harness import Harness, Sequence
from tests.worker.hf_reference import greedy, last_logits, load_reference, save_tiny

LOGIT_TOL = 1e-4
PROMPT_LENGTHS = (1, 7, 64, 300, 700)
# transformers' generate is slow on long prompts: variants generate from prompts up to 300 tokens.
SHORT_PROMPT_LENGTHS = (1, 7, 64, 300)


def prompt(vocab: int, length: int, seed: int) -> list[int]:
    """A reproducible random prompt."""
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_states_close(actual: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]) -> None:
    assert len(actual) == len(expected) > 0
    for layer_a, layer_e in zip(actual, expected, strict=True):
        assert layer_a.keys() == layer_e.keys()
        for name in layer_a:
            torch.testing.assert_close(layer_a[name], layer_e[name], rtol=1e-4, atol=1e-5)


def assert_prefill_parity(ours: HybridModel, ref: Any, lengths: tuple[int, ...]) -> None:
    """Last-token logits of one prefill equal transformers' for each prompt length."""
    for length in lengths:
        ids = prompt(ours.vocab_size, length, seed=length)
        harness = Harness(ours, num_pages=64)
        logits = harness.prefill([harness.new_sequence()], [ids])
        expected = last_logits(ref, ids)
        assert logits.shape == (1, ours.vocab_size)
        err = (logits[0] - expected).abs().max().item()
        assert err < LOGIT_TOL, f"prompt length {length}: max logit error {err}"


def assert_greedy_parity(ours: HybridModel, ref: Any, lengths: tuple[int, ...], new_tokens: int = 32) -> None:
    """All prompts generated together (one batch) give transformers' greedy tokens for each prompt."""
    prompts = [prompt(ours.vocab_size, n, seed=100 + n) for n in lengths]
    expected = [greedy(ref, p, new_tokens) for p in prompts]
    got = Harness(ours, num_pages=sum(-(-(n + new_tokens) // 16) for n in lengths) + 8).generate_greedy(
        prompts, new_tokens
    )
    for n, g, e in zip(lengths, got, expected, strict=True):
        assert g == e, f"prompt length {n}"


def assert_batch_equals_one_by_one(model: HybridModel, new_tokens: int = 10) -> None:
    """Prompts of mixed lengths in one batch generate what each does alone."""
    prompts = [prompt(model.vocab_size, n, seed=i) for i, n in enumerate((1, 3, 17, 33, 64, 5, 90, 2))]
    together = Harness(model, num_pages=128).generate_greedy(prompts, new_tokens)
    alone = [Harness(model).generate_greedy([p], new_tokens)[0] for p in prompts]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1  # the prompts really lead to different outputs


def assert_split_prefill_equals_one_prefill(model: HybridModel) -> None:
    """A prompt prefilled in two parts (the second batched with a fresh sequence) equals one prefill:
    logits, final state and the next greedy tokens."""
    ids = prompt(model.vocab_size, 100, seed=1)
    whole = Harness(model)
    seq_w = whole.new_sequence()
    logits_w = whole.prefill([seq_w], [ids])

    split = Harness(model, seed=5)
    seq_s, other = split.new_sequence(), split.new_sequence()
    split.prefill([seq_s], [ids[:37]])
    logits_s = split.prefill([other, seq_s], [ids[:9], ids[37:]])[1:]

    torch.testing.assert_close(logits_s, logits_w, rtol=1e-4, atol=1e-5)
    assert_states_close(split.read_state(seq_s.state_slot), whole.read_state(seq_w.state_slot))
    tokens_w, tokens_s = [], []
    for _ in range(6):
        tokens_w.append(int(logits_w.argmax()))
        tokens_s.append(int(logits_s.argmax()))
        logits_w = whole.decode([seq_w], tokens_w[-1:])
        logits_s = split.decode([seq_s], tokens_s[-1:])
    assert tokens_s == tokens_w


def assert_captures_equal_prefix_prefills(model: HybridModel) -> None:
    """A state captured at offset k of a prefill equals the final state of a prefill of exactly k tokens."""
    ids = prompt(model.vocab_size, 100, seed=2)
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
        assert_states_close(harness.read_state(slots[off]), fresh.read_state(s.state_slot))
    assert_states_close(harness.read_state(seq.state_slot), harness.read_state(slots[100]))


def _reuse(harness: Harness, donor: Sequence, cached_slot: int, prefix_len: int) -> Sequence:
    reuser = harness.new_sequence()
    reuser.pages = donor.pages[: prefix_len // harness.page_size]
    reuser.length = prefix_len
    harness.copy_state(cached_slot, reuser.state_slot)
    return reuser


def assert_restored_capture_continues(model: HybridModel) -> None:
    """Device-tier prefix hit: a new sequence takes a donor's KV pages and captured state, then
    diverges; its logits and greedy tokens equal those of a full prefill."""
    prefix = prompt(model.vocab_size, 48, seed=3)
    suffix = prompt(model.vocab_size, 21, seed=5)
    harness = Harness(model, page_size=16)
    donor = harness.new_sequence()
    cached = harness.alloc_state_slot()
    harness.prefill([donor], [prefix + prompt(model.vocab_size, 30, seed=4)], captures=[[Capture(48, cached)]])
    reuser = _reuse(harness, donor, cached, 48)
    logits = harness.prefill([reuser], [suffix])

    fresh = Harness(model)
    seq = fresh.new_sequence()
    expected = fresh.prefill([seq], [prefix + suffix])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    tokens, tokens_fresh = [], []
    for _ in range(6):
        tokens.append(int(logits.argmax()))
        tokens_fresh.append(int(expected.argmax()))
        logits = harness.decode([reuser], tokens[-1:])
        expected = fresh.decode([seq], tokens_fresh[-1:])
    assert tokens == tokens_fresh


def assert_host_round_trip_continues(model: HybridModel) -> None:
    """Host-tier prefix hit: the prefix's KV pages and captured state go to the shared host pools
    (d2h), the device copies are wiped, they come back to other pages and slot (h2d), and the
    continuation equals a full prefill. A model without attention gets no host KV pool (a KV pool
    of zero layers cannot be mapped in shared memory today). Both copy paths: pageable, and the
    packed runs pinned host pools get on CUDA."""
    for packed in (False, True):
        _host_round_trip(model, packed)


def _host_round_trip(model: HybridModel, packed: bool) -> None:
    prefix = prompt(model.vocab_size, 32, seed=6)
    suffix = prompt(model.vocab_size, 13, seed=7)
    harness = Harness(model, page_size=16, num_pages=32)
    donor = harness.new_sequence()
    cached = harness.alloc_state_slot()
    harness.prefill([donor], [prefix + suffix[:3]], captures=[[Capture(32, cached)]])
    prefix_pages = donor.pages[:2]

    has_kv = model.kv_spec().num_layers > 0
    layout: HostPoolLayout = host_layout(harness.kv, harness.state, num_pages=4 if has_kv else 0, num_slots=2)
    transfer = HostTransfer(harness.kv, harness.state, layout, torch.device("cpu"), packed=packed)
    try:
        transfer.run(
            Transfer(
                op_id=1,
                direction="d2h",
                kv_src=prefix_pages if has_kv else [],
                kv_dst=[1, 3] if has_kv else [],
                state_src=[cached],
                state_dst=[1],
            )
        )
        for t in harness.kv.k + harness.kv.v:
            t.zero_()
        harness.state.zero(torch.arange(harness.state.num_slots))
        reuser = harness.new_sequence()
        harness.token_slots(reuser, 0, 32)  # two fresh pages, not the donor's
        transfer.run(
            Transfer(
                op_id=2,
                direction="h2d",
                kv_src=[1, 3] if has_kv else [],
                kv_dst=reuser.pages if has_kv else [],
                state_src=[1],
                state_dst=[reuser.state_slot],
            )
        )
    finally:
        transfer.close()
    reuser.length = 32
    logits = harness.prefill([reuser], [suffix])

    fresh = Harness(model)
    expected = fresh.prefill([fresh.new_sequence()], [prefix + suffix])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


def assert_fresh_sequence_ignores_its_slot(model: HybridModel) -> None:
    """A sequence with no cached prefix never reads what its state slot held, and its prefill
    overwrites all of it (the worker does not zero such a slot first): the next decode step reads
    only what the prefill wrote."""
    ids = prompt(model.vocab_size, 10, seed=6)
    clean = Harness(model)
    clean_seq = clean.new_sequence()
    expected = clean.prefill([clean_seq], [ids])
    dirty = Harness(model)
    for layer in dirty.state.tensors:
        for t in layer.values():
            t.fill_(3.0)
    dirty_seq = dirty.new_sequence()
    torch.testing.assert_close(dirty.prefill([dirty_seq], [ids]), expected)
    next_token = int(expected[0].argmax())
    torch.testing.assert_close(dirty.decode([dirty_seq], [next_token]), clean.decode([clean_seq], [next_token]))


CACHE_CHECKS = (
    assert_batch_equals_one_by_one,
    assert_split_prefill_equals_one_prefill,
    assert_captures_equal_prefix_prefills,
    assert_restored_capture_continues,
    assert_host_round_trip_continues,
    assert_fresh_sequence_ignores_its_slot,
)


def family_checkpoints(
    root: Path, arch: str, architecture: str, variant: str, modelgen_seed: int = 3, **overrides: Any
) -> dict[str, Path]:
    """A family's checkpoints under `root`: "transformers" (its tiny config), `variant` (the tiny config
    with `overrides`, seed 1) and "modelgen" (our checkpoint maker's tiny preset of `arch`)."""
    return {
        "transformers": save_tiny(architecture, root / "hf"),
        variant: save_tiny(architecture, root / "variant", seed=1, **overrides),
        "modelgen": make_checkpoint(arch, root / "gen", preset="tiny", seed=modelgen_seed),
    }


def load_sources(paths: Mapping[str, Path]) -> dict[str, tuple[HybridModel, Any]]:
    """Each checkpoint as (our model, transformers' model)."""
    return {name: (load_model(path), load_reference(path)) for name, path in paths.items()}


def prefill_parity_test(sources: tuple[str, ...]) -> Callable[..., None]:
    """The test of prefill logits against transformers for each of `sources` (a `models` fixture's keys)."""

    @pytest.mark.parametrize("source", sources)
    def test_prefill_logits_match_transformers(models: dict, source: str) -> None:
        ours, ref = models[source]
        assert_prefill_parity(ours, ref, PROMPT_LENGTHS)

    return test_prefill_logits_match_transformers


def greedy_parity_test(
    sources: tuple[str, ...], long_sources: tuple[str, ...] = ("transformers",)
) -> Callable[..., None]:
    """The test of batched greedy generation against transformers for each of `sources`; prompts of up
    to 700 tokens for `long_sources`, up to 300 for the others."""

    @pytest.mark.parametrize("source", sources)
    def test_greedy_generation_matches_transformers(models: dict, source: str) -> None:
        ours, ref = models[source]
        assert_greedy_parity(ours, ref, PROMPT_LENGTHS if source in long_sources else SHORT_PROMPT_LENGTHS)

    return test_greedy_generation_matches_transformers


def cache_behaviour_test() -> Callable[..., None]:
    """The test running every one of CACHE_CHECKS on the "transformers" model of a `models` fixture."""

    @pytest.mark.parametrize("check", CACHE_CHECKS, ids=lambda c: c.__name__.removeprefix("assert_"))
    def test_cache_behaviour(models: dict, check: Callable[[HybridModel], None]) -> None:
        check(models["transformers"][0])

    return test_cache_behaviour
