"""Page keys: chained, salted by the model fingerprint, whole pages only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from himamba.services.cache.keys import KEY_BYTES, model_fingerprint, page_keys

FP_A = bytes(range(32))
FP_B = bytes(range(1, 33))

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=80)


def test_same_tokens_same_keys_and_one_key_per_whole_page() -> None:
    tokens = list(range(100, 150))
    keys = page_keys(None, tokens, 16, FP_A)
    assert len(keys) == 3  # 50 tokens: 3 whole pages, the 2-token tail has no key
    assert all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 3
    assert keys == page_keys(None, tuple(tokens), 16, FP_A)
    assert page_keys(None, tokens[:48], 16, FP_A) == keys
    assert page_keys(None, tokens[:15], 16, FP_A) == []


@settings(max_examples=60, deadline=None)
@given(tokens=token_lists, page_size=st.integers(1, 9), cut=st.integers(0, 10))
def test_chaining_from_a_parent_equals_hashing_the_whole_prefix(tokens: list[int], page_size: int, cut: int) -> None:
    whole = page_keys(None, tokens, page_size, FP_A)
    split = min(cut, len(whole)) * page_size
    head = page_keys(None, tokens[:split], page_size, FP_A)
    tail = page_keys(head[-1] if head else None, tokens[split:], page_size, FP_A)
    assert head + tail == whole


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 50000), min_size=4, max_size=40))
def test_another_fingerprint_never_shares_a_key(tokens: list[int]) -> None:
    a = page_keys(None, tokens, 4, FP_A)
    b = page_keys(None, tokens, 4, FP_B)
    assert not set(a) & set(b)


def test_a_changed_token_changes_its_page_and_every_later_page_only() -> None:
    tokens = list(range(64))
    edited = tokens.copy()
    edited[20] = 9999  # page 1 of 4 (page size 16)
    a = page_keys(None, tokens, 16, FP_A)
    b = page_keys(None, edited, 16, FP_A)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:]))


def test_the_same_page_under_another_parent_gets_another_key() -> None:
    page = list(range(8))
    (root_key,) = page_keys(None, page, 8, FP_A)
    (child_key,) = page_keys(root_key, page, 8, FP_A)
    assert child_key != root_key


@pytest.mark.parametrize(
    ("parent", "tokens", "page_size", "fp", "field"),
    [
        (None, [1, -1], 2, FP_A, "tokens"),
        (None, [1, 2**32], 2, FP_A, "tokens"),
        (None, [1.5, 2], 2, FP_A, "tokens"),
        (b"short", [1, 2], 2, FP_A, "parent_key"),
        (None, [1, 2], 0, FP_A, "page_size"),
        (None, [1, 2], 2, b"x", "fingerprint"),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(parent, tokens, page_size, fp, field) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=field):
        page_keys(parent, tokens, page_size, fp)


def _model_dir(tmp_path: Path, scale: float = 1.0, big: int = 0) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["NemotronHForCausalLM"], "hidden_size": 8}))
    tensors = {"w": torch.full((4, 4), scale), "big": torch.zeros(big, dtype=torch.uint8)}
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_fingerprint_is_stable_and_salted_by_dtype_page_size_config_and_weights(tmp_path: Path) -> None:
    d = _model_dir(tmp_path)
    fp = model_fingerprint(d, "float32", 16)
    assert len(fp) == 32
    assert fp == model_fingerprint(d, "float32", 16)
    assert fp != model_fingerprint(d, "bfloat16", 16)
    assert fp != model_fingerprint(d, "float32", 32)
    assert fp == model_fingerprint(d, "float32", 16, tp_size=1)  # unsharded keys are what they were
    assert fp != model_fingerprint(d, "float32", 16, tp_size=2)  # a sharded page's blob is laid out per rank
    (d / "config.json").write_text(json.dumps({"architectures": ["NemotronHForCausalLM"], "hidden_size": 16}))
    fp_config = model_fingerprint(d, "float32", 16)
    assert fp_config != fp
    _model_dir(tmp_path, scale=2.0)  # same shapes and header, other weights
    assert model_fingerprint(d, "float32", 16) not in (fp, fp_config)


def test_fingerprint_sees_the_end_of_a_large_weights_file(tmp_path: Path) -> None:
    d = _model_dir(tmp_path, big=3 << 20)
    fp = model_fingerprint(d, "float32", 16)
    path = d / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the last MiB, far from the header
    path.write_bytes(bytes(data))
    assert model_fingerprint(d, "float32", 16) != fp


def test_fingerprint_needs_a_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model_dir"):
        model_fingerprint(tmp_path, "float32", 16)
