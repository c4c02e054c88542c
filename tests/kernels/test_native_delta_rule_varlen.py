"""The native varlen gated delta rule (every sequence of a step in one call, states straight from and into
the pool, captures at any offset) against `segmented`'s loop over the chunked PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from himamba.kernels import dispatch, segmented
from himamba.kernels.native import build
from himamba.kernels.native import delta_rule as native_delta_rule
from himamba.kernels.reference import delta_rule
from himamba.kernels.varlen import make_varlen
from tests.kernels.varlen_batch import SLOTS, layout, named_slots

pytestmark = pytest.mark.skipif(
    build.native_build().library is None, reason=f"native kernels {build.native_build().detail}"
)

CHUNK = 16
TOL = {"rtol": 1e-5, "atol": 1e-5}
# (new tokens, prefix, capture offsets) per sequence: a fresh sequence shorter than a chunk; one continuing
# a prefix with captures on both sides of chunk boundaries (16, 32, 64), inside a chunk and at its end;
# one with two slots at one offset and a capture at token 1; one capture-free; one token.
BATCH = [
    (3, 0, [2]),
    (70, 17, [5, 15, 16, 17, 31, 32, 33, 64, 70]),
    (40, 0, [1, 16, 16, 37]),
    (100, 4, []),
    (1, 9, [1]),
]


def _inputs(k_heads: int, v_heads: int, k_dim: int, v_dim: int):
    gen = torch.Generator().manual_seed(k_heads * 1000 + v_heads * 100 + k_dim + v_dim)
    v, slots = layout(BATCH)
    t = v.num_tokens
    # q, k and v as views into the rows of one conv output, as the layer hands them over.
    qk = k_heads * k_dim
    mixed = torch.randn(t, 2 * qk + v_heads * v_dim + 3, generator=gen)
    q = mixed[:, :qk].view(t, k_heads, k_dim)
    k = mixed[:, qk : 2 * qk].view(t, k_heads, k_dim)
    val = mixed[:, 2 * qk : 2 * qk + v_heads * v_dim].view(t, v_heads, v_dim)
    g = -2.0 * torch.rand(t, v_heads, generator=gen)
    # beta as a column block of a wider tensor (a token stride above Hv).
    beta = torch.rand(t, v_heads + 2, generator=gen)[:, 1 : 1 + v_heads]
    pool = torch.randn(SLOTS, v_heads, k_dim, v_dim, generator=gen)
    return q, k, val, g, beta, pool, slots, v


@pytest.mark.parametrize(
    ("k_heads", "v_heads", "k_dim", "v_dim"),
    [
        (2, 2, 16, 32),  # Hv == Hk, one full block of columns
        (2, 4, 16, 48),  # Hv = 2 Hk, a block and a half
        (1, 2, 7, 5),  # sizes off the vector width
    ],
)
@pytest.mark.parametrize(("use_qk_l2norm", "scale"), [(True, None), (False, 0.1), (True, 0.5)])
def test_equals_the_segment_loop_of_the_reference(k_heads, v_heads, k_dim, v_dim, use_qk_l2norm, scale) -> None:
    q, k, val, g, beta, pool, slots, v = _inputs(k_heads, v_heads, k_dim, v_dim)
    if not use_qk_l2norm:  # raw q and k of a size the recurrence stays bounded with
        q, k = q / k_dim**0.5, k / k_dim**0.5
    before, want_pool = pool.clone(), pool.clone()
    args = (q, k, val, g, beta, CHUNK)
    want = segmented.gated_delta_rule_varlen(
        delta_rule.chunk_gated_delta_rule, *args, want_pool, slots, v, use_qk_l2norm, scale
    )
    got = native_delta_rule.gated_delta_rule_varlen(*args, pool, slots, v, use_qk_l2norm, scale)
    torch.testing.assert_close(got, want, **TOL)
    # Every slot named (captures and finals) holds what the loop wrote; every other slot is as it was.
    torch.testing.assert_close(pool, want_pool, **TOL)
    named = named_slots(v, slots)
    others = [s for s in range(SLOTS) if s not in named]
    assert others and torch.equal(pool[others], before[others])


def test_the_dispatcher_runs_it_for_float32_cpu_tensors(monkeypatch) -> None:
    q, k, val, g, beta, pool, slots, v = _inputs(2, 4, 16, 48)
    calls = []
    real = native_delta_rule.gated_delta_rule_varlen
    monkeypatch.setattr(native_delta_rule, "gated_delta_rule_varlen", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv(dispatch.KERNELS_ENV, "native")
    dispatch.kernels_mode.cache_clear()
    try:
        want = real(q, k, val, g, beta, CHUNK, pool.clone(), slots, v, True, None)
        got = dispatch.chunk_gated_delta_rule_varlen(q, k, val, g, beta, CHUNK, pool, slots, v)
    finally:
        monkeypatch.delenv(dispatch.KERNELS_ENV)
        dispatch.kernels_mode.cache_clear()
    assert calls == [1]
    assert torch.equal(got, want)


def test_a_fresh_sequence_never_reads_its_slot() -> None:
    q, k, val, g, beta, pool, slots, v = _inputs(2, 4, 16, 48)
    args = (q, k, val, g, beta, CHUNK)
    first = native_delta_rule.gated_delta_rule_varlen(*args, pool.clone(), slots, v)
    garbage = pool.clone()
    fresh = [b for b, (_, prefix, _) in enumerate(BATCH) if prefix == 0]
    garbage[slots[fresh]] = float("nan")
    again = native_delta_rule.gated_delta_rule_varlen(*args, garbage, slots, v)
    assert torch.equal(first, again)
    assert not garbage[slots[fresh]].isnan().any()  # their final states replaced the NaNs


def test_writes_nothing_when_a_slot_is_outside_the_pool() -> None:
    q, k, val, g, beta, pool, slots, v = _inputs(2, 4, 16, 48)
    kept = pool.clone()
    bad = slots.clone()
    bad[3] = SLOTS
    with pytest.raises(ValueError, match="outside the pool's 40 slots"):
        native_delta_rule.gated_delta_rule_varlen(q, k, val, g, beta, CHUNK, pool, bad, v)
    assert torch.equal(pool, kept)
    bad[3] = -1
    with pytest.raises(ValueError, match="outside the pool's 40 slots"):
        native_delta_rule.gated_delta_rule_varlen(q, k, val, g, beta, CHUNK, pool, bad, v)
    assert torch.equal(pool, kept)
    caps = [[(o, SLOTS + 2 if o == 64 else s) for o, s in c] for c in v.captures]
    v2 = make_varlen(v.new_lens, v.prefix_lens, caps, torch.device("cpu"))
    with pytest.raises(ValueError, match="outside the pool"):
        native_delta_rule.gated_delta_rule_varlen(q, k, val, g, beta, CHUNK, pool, slots, v2)
    assert torch.equal(pool, kept)


def test_refuses_a_pool_of_another_shape() -> None:
    q, k, val, g, beta, pool, slots, v = _inputs(2, 4, 16, 48)
    with pytest.raises(ValueError, match="state_pool must be"):
        native_delta_rule.gated_delta_rule_varlen(q, k, val, g, beta, CHUNK, pool.transpose(2, 3), slots, v)
