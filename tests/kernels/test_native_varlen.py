"""The native varlen prefill kernels (one call for every sequence of a step, states straight from and into
the pool) against `segmented`'s loop over the per-segment references: the conv and Mamba2's scan."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from himamba.kernels import segmented
from himamba.kernels.native import attention as native_attention
from himamba.kernels.native import build
from himamba.kernels.native import conv1d as native_conv1d
from himamba.kernels.native import ssd as native_ssd
from himamba.kernels.reference import conv1d, ssd
from himamba.kernels.varlen import Varlen, make_varlen
from tests.kernels.test_attention import DH, NEW_LENS, PREFIX_LENS, make_batch
from tests.kernels.varlen_batch import SLOTS, layout

pytestmark = pytest.mark.skipif(
    build.native_build().library is None, reason=f"native kernels {build.native_build().detail}"
)

# (new tokens, prefix, capture offsets) per sequence: a fresh sequence shorter than the conv window and
# than a chunk; one continuing a prefix with captures on both sides of a chunk boundary (32 on CPU) and
# at its end; one with two slots at one offset and a capture at token 1; one capture-free; one token.
BATCH = [
    (3, 0, [2]),
    (70, 17, [5, 31, 32, 33, 64, 70]),
    (40, 0, [1, 16, 16, 37]),
    (100, 4, []),
    (1, 9, [1]),
]


def _conv_inputs(channels: int, width: int, bias: bool):
    gen = torch.Generator().manual_seed(channels * 10 + width)
    v, slots = layout(BATCH)
    # x as a column block of a wider projection's rows (token stride > channels).
    x = torch.randn(v.num_tokens, channels + 5, generator=gen)[:, 2 : 2 + channels]
    weight = torch.randn(channels, width, generator=gen)
    b = torch.randn(channels, generator=gen) if bias else None
    pool = torch.randn(SLOTS, channels, width - 1, generator=gen)
    return x, weight, b, pool, slots, v


@pytest.mark.parametrize(
    ("channels", "width", "bias", "activation"),
    [(48, 4, True, "silu"), (20, 4, False, None), (33, 2, True, "silu"), (16, 5, True, "silu")],
)
def test_conv_equals_the_segment_loop_of_the_reference(channels, width, bias, activation) -> None:
    x, weight, b, pool, slots, v = _conv_inputs(channels, width, bias)
    want_pool = pool.clone()
    want = segmented.conv1d_varlen(conv1d.causal_conv1d, x, weight, b, want_pool, slots, v, activation)
    got = native_conv1d.causal_conv1d_varlen(x, weight, b, pool, slots, v, activation)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Every written slot holds what the loop wrote; every other slot is as it was.
    torch.testing.assert_close(pool, want_pool, rtol=0, atol=0)


def test_conv_writes_nothing_when_a_slot_is_outside_the_pool() -> None:
    x, weight, b, pool, slots, v = _conv_inputs(24, 4, True)
    kept = pool.clone()
    bad = slots.clone()
    bad[3] = SLOTS
    with pytest.raises(ValueError, match="outside the pool's 40 slots"):
        native_conv1d.causal_conv1d_varlen(x, weight, b, pool, bad, v, "silu")
    assert torch.equal(pool, kept)
    caps = [[(o, SLOTS + 2 if o == 64 else s) for o, s in c] for c in v.captures]
    v2 = make_varlen(v.new_lens, v.prefix_lens, caps, torch.device("cpu"))
    with pytest.raises(ValueError, match="outside the pool"):
        native_conv1d.causal_conv1d_varlen(x, weight, b, pool, slots, v2, "silu")
    assert torch.equal(pool, kept)


def _scan_inputs(heads: int, head_dim: int, groups: int, n: int):
    gen = torch.Generator().manual_seed(heads * 100 + n)
    v, slots = layout(BATCH)
    t = v.num_tokens
    # x, B and C as views into the rows of one projection, as the layer hands them over.
    gn = groups * n
    proj = torch.randn(t, heads * head_dim + 2 * gn + 3, generator=gen)
    x = proj[:, : heads * head_dim].view(t, heads, head_dim)
    B = proj[:, heads * head_dim : heads * head_dim + gn].view(t, groups, n)
    C = proj[:, heads * head_dim + gn : heads * head_dim + 2 * gn].view(t, groups, n)
    dt = torch.randn(t, heads, generator=gen)
    A = -torch.rand(heads, generator=gen) * 2
    D = torch.randn(heads, generator=gen)
    dt_bias = torch.randn(heads, generator=gen)
    pool = torch.randn(SLOTS, heads, head_dim, n, generator=gen)
    return x, dt, A, B, C, D, dt_bias, pool, slots, v


@pytest.mark.parametrize(
    ("heads", "head_dim", "groups", "n", "chunk", "limit", "skip"),
    [
        (4, 16, 2, 16, 128, (0.0, math.inf), True),  # chunks of the CPU's 32 tokens
        (6, 8, 3, 24, 8, (0.01, 0.5), False),  # short chunks, dt clamped, no D
        (2, 20, 1, 12, 64, (0.0, math.inf), True),  # sizes off the vector width
    ],
)
def test_scan_equals_the_segment_loop_of_the_reference(heads, head_dim, groups, n, chunk, limit, skip) -> None:
    x, dt, A, B, C, D, dt_bias, pool, slots, v = _scan_inputs(heads, head_dim, groups, n)
    D = D if skip else None
    want_pool = pool.clone()
    args = (x, dt, A, B, C, chunk, D, dt_bias, True, limit)
    want = segmented.ssd_scan_varlen(ssd.ssd_scan, *args, want_pool, slots, v)
    got = native_ssd.ssd_scan_varlen(*args, pool, slots, v)
    scale = want.abs().max()
    torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=1e-5)
    torch.testing.assert_close(pool, want_pool, rtol=1e-4, atol=1e-5)


def test_scan_equals_its_native_segment_loop_exactly() -> None:
    """The varlen kernel chunks each segment as `ssd_scan` does: the same float operations."""
    x, dt, A, B, C, D, dt_bias, pool, slots, v = _scan_inputs(4, 16, 2, 16)
    want_pool = pool.clone()
    args = (x, dt, A, B, C, 128, D, dt_bias, True, (0.0, math.inf))
    want = segmented.ssd_scan_varlen(native_ssd.ssd_scan, *args, want_pool, slots, v)
    got = native_ssd.ssd_scan_varlen(*args, pool, slots, v)
    assert torch.equal(got, want)
    assert torch.equal(pool, want_pool)


def test_a_fresh_sequence_never_reads_its_slot() -> None:
    x, dt, A, B, C, D, dt_bias, pool, slots, v = _scan_inputs(4, 16, 2, 16)
    args = (x, dt, A, B, C, 128, D, dt_bias, True, (0.0, math.inf))
    first = native_ssd.ssd_scan_varlen(*args, pool.clone(), slots, v)
    garbage = pool.clone()
    fresh = [b for b, (_, prefix, _) in enumerate(BATCH) if prefix == 0]
    garbage[slots[fresh]] = float("nan")
    again = native_ssd.ssd_scan_varlen(*args, garbage, slots, v)
    assert torch.equal(first, again)


def test_scan_writes_nothing_when_a_slot_is_outside_the_pool() -> None:
    x, dt, A, B, C, D, dt_bias, pool, slots, v = _scan_inputs(4, 16, 2, 16)
    kept = pool.clone()
    bad = slots.clone()
    bad[0] = -1
    with pytest.raises(ValueError, match="outside the pool's 40 slots"):
        native_ssd.ssd_scan_varlen(x, dt, A, B, C, 128, D, dt_bias, True, (0.0, math.inf), pool, bad, v)
    assert torch.equal(pool, kept)


def test_negative_lengths_are_refused_by_the_layout() -> None:
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        make_varlen([-3000, 3000], [0, 0], [], torch.device("cpu"))
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        make_varlen([4], [-1], [], torch.device("cpu"))


def _all_native_ops(v: Varlen, slots: torch.Tensor):
    """Each native varlen op on `v`'s tokens (sizes small), as zero-argument calls."""
    from himamba.kernels.native import attention as native_attention
    from himamba.kernels.native import delta_rule as native_delta_rule
    from himamba.kernels.native import selective_scan as native_selective_scan

    t, gen = v.num_tokens, torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen)
    u = lambda *shape: torch.rand(*shape, generator=gen)
    pool = lambda *row: torch.zeros(SLOTS, *row)
    table = torch.arange(v.num_seqs * 64).view(v.num_seqs, 64)
    return {
        "conv": lambda: native_conv1d.causal_conv1d_varlen(r(t, 8), r(8, 4), None, pool(8, 3), slots, v, "silu"),
        "ssd": lambda: native_ssd.ssd_scan_varlen(
            r(t, 2, 4),
            r(t, 2),
            -u(2),
            r(t, 1, 4),
            r(t, 1, 4),
            32,
            None,
            None,
            True,
            (0.0, math.inf),
            pool(2, 4, 4),
            slots,
            v,
        ),
        "selective_scan": lambda: native_selective_scan.selective_scan_varlen(
            r(t, 8), r(t, 8), -u(8, 4), r(t, 4), r(t, 4), None, None, None, True, pool(8, 4), slots, v
        ),
        "delta_rule": lambda: native_delta_rule.gated_delta_rule_varlen(
            r(t, 1, 4), r(t, 1, 4), r(t, 2, 4), -u(t, 2), u(t, 2), 64, pool(2, 4, 4), slots, v
        ),
        "attention": lambda: native_attention.paged_attention_prefill_varlen(
            r(t, 2, 4), r(SLOTS * 64, 1, 4), r(SLOTS * 64, 1, 4), table, v, 0.5
        ),
    }


@pytest.mark.parametrize("op", ["conv", "ssd", "selective_scan", "delta_rule", "attention"])
def test_the_kernels_read_the_checked_host_lengths_not_the_layouts_tensors(op: str) -> None:
    """A layout whose tensors disagree with its host tuples (or live on another device) cannot steer the
    C: it reads index arrays rebuilt from the tuples the arguments were checked against."""
    honest = make_varlen([4, 6], [0, 3], [[(2, 5)], []], torch.device("cpu"))
    slots = torch.tensor([0, 1])
    want = _all_native_ops(honest, slots)[op]()
    lying = make_varlen([400_000, 6], [0, 3], [[(2, 5)], []], torch.device("cpu"))._replace(new_lens=(4, 6))
    torch.testing.assert_close(_all_native_ops(lying, slots)[op](), want)
    elsewhere = make_varlen([4, 6], [0, 3], [[(2, 5)], []], torch.device("meta"))
    torch.testing.assert_close(_all_native_ops(elsewhere, slots)[op](), want)


@pytest.mark.parametrize("op", ["conv", "ssd", "selective_scan", "delta_rule"])
def test_slots_must_be_int64_on_the_cpu(op: str) -> None:
    v = make_varlen([4, 6], [0, 3], [[(2, 5)], []], torch.device("cpu"))
    for slots in (
        torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([0.0, 1.0]),
        torch.tensor([0, 1], device="meta"),
    ):
        with pytest.raises(ValueError, match="state_slots must be a \\[2\\] int64 CPU tensor"):
            _all_native_ops(v, slots)[op]()


@pytest.mark.parametrize("seq", [0, 3, 6])
@pytest.mark.parametrize("bad", [-1, 1000])
def test_prefill_attention_refuses_a_slot_outside_the_pool(seq: int, bad: int) -> None:
    """In any sequence, in its prefix or its new tokens: a ValueError, and nothing is written."""
    q, k_cache, v_cache, table = make_batch(4, 2, seed=3)
    table[seq, PREFIX_LENS[seq] + NEW_LENS[seq] - 1] = bad
    v = make_varlen(NEW_LENS, PREFIX_LENS, [], q.device)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match="outside the pool's 1000"):
        native_attention.paged_attention_prefill_varlen(q, k_cache, v_cache, table, v, 0.2)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    # The kernel itself, into an `out` it must leave as it was.
    out = torch.full_like(q, float("nan"))
    lengths = torch.tensor([0, *itertools.accumulate(NEW_LENS), *PREFIX_LENS], dtype=torch.int64)
    library = build.native_build().library
    status = library.hm_paged_attention_prefill_varlen_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), lengths.data_ptr(),
        lengths[len(NEW_LENS) + 1 :].data_ptr(), out.data_ptr(), len(NEW_LENS), q.shape[0], table.shape[1], table.stride(0), 4, 2, DH, 1000, 0.2,
    )  # fmt: skip
    assert status == -1
    assert out.isnan().all()
