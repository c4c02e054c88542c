"""The native varlen Mamba1 scan (every sequence of a step in one call, states straight from and into the
pool, captures at any offset) against `segmented`'s loop over the per-segment reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from himamba.kernels import dispatch, segmented
from himamba.kernels.native import build
from himamba.kernels.native import selective_scan as native
from himamba.kernels.reference import selective_scan as reference
from himamba.kernels.varlen import make_varlen
from tests.kernels.varlen_batch import SLOTS, layout, named_slots

pytestmark = pytest.mark.skipif(
    build.native_build().library is None, reason=f"native kernels {build.native_build().detail}"
)

# (new tokens, prefix, capture offsets) per sequence: a fresh short one; one continuing a prefix with
# captures at 5, in the middle and at its end; one with a capture at token 1 and two slots at one
# offset; one capture-free and long enough for the reference's chunked form; one token.
BATCH = [
    (3, 0, [2]),
    (70, 17, [5, 31, 32, 33, 64, 70]),
    (40, 0, [1, 16, 16, 37]),
    (100, 4, []),
    (1, 9, [1]),
]


def _inputs(channels: int, n: int, softplus: bool):
    """u and z as column blocks of one projection's rows, B and C of another's (as the layer hands
    them over: token strides wider than their rows); delta positive when it is not softplus'd."""
    gen = torch.Generator().manual_seed(channels * 100 + n)
    v, slots = layout(BATCH)
    t = v.num_tokens
    in_proj = torch.randn(t, 2 * channels + 3, generator=gen)
    u, z = in_proj[:, :channels], in_proj[:, channels + 3 :]
    x_proj = torch.randn(t, 2 * n + 5, generator=gen)
    B, C = x_proj[:, 5 : 5 + n], x_proj[:, 5 + n :]
    delta = torch.randn(t, channels, generator=gen) if softplus else torch.rand(t, channels, generator=gen) * 0.5
    A = -torch.exp(torch.randn(channels, n, generator=gen) * 0.5)
    D = torch.randn(channels, generator=gen)
    delta_bias = torch.randn(channels, generator=gen) * 0.1
    pool = torch.randn(SLOTS, channels, n, generator=gen)
    return u, delta, A, B, C, D, z, delta_bias, pool, slots, v


@pytest.mark.parametrize(
    ("channels", "n", "skip", "gate", "bias", "softplus"),
    [
        (48, 16, True, True, True, True),  # Jamba's layer: every option
        (20, 12, False, False, False, False),  # none of them; channels and N off the vector width
        (33, 16, False, True, True, True),  # a gate without D; a one-channel tail block
        (64, 8, True, False, False, True),  # D without a gate
    ],
)
def test_native_equals_the_segment_loop_of_the_reference(channels, n, skip, gate, bias, softplus) -> None:
    u, delta, A, B, C, D, z, delta_bias, pool, slots, v = _inputs(channels, n, softplus)
    D, z, delta_bias = (D if skip else None), (z if gate else None), (delta_bias if bias else None)
    kept = pool.clone()
    want_pool = pool.clone()
    args = (u, delta, A, B, C, D, z, delta_bias, softplus)
    want = segmented.selective_scan_varlen(reference.selective_scan, *args, want_pool, slots, v)
    got = native.selective_scan_varlen(*args, pool, slots, v)
    scale = want.abs().max()
    torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=1e-5)
    torch.testing.assert_close(pool, want_pool, rtol=1e-4, atol=1e-5)
    # Slots the batch does not name are exactly as they were.
    others = [s for s in range(SLOTS) if s not in named_slots(v, slots)]
    assert others and torch.equal(pool[others], kept[others])


def test_a_capture_equals_the_final_state_of_a_prefill_of_that_prefix() -> None:
    u, delta, A, B, C, D, z, delta_bias, pool, slots, v = _inputs(48, 16, True)
    native.selective_scan_varlen(u, delta, A, B, C, D, z, delta_bias, True, pool, slots, v)
    b, start = 2, sum(n for n, _, _ in BATCH[:2])  # a fresh sequence: its prefix starts from zeros
    for offset, slot in v.captures[b]:
        rows = slice(start, start + offset)
        alone = reference.selective_scan(
            u[None, rows], delta[None, rows], A, B[None, rows], C[None, rows], D, z[None, rows], delta_bias, True
        )
        torch.testing.assert_close(pool[slot], alone.final_state[0], rtol=1e-4, atol=1e-5)


def test_the_softplus_of_delta_is_torchs_to_two_ulp() -> None:
    """With A = 0, N = 1 and u = B = C = 1, one token's y is its dt: the kernel's vectorised softplus."""
    x = torch.cat([torch.linspace(-80, 40, 48001), torch.tensor([0.0, 20.0, 19.9999, 20.0001, 1e-8, -1e-8])])
    channels = x.numel()
    v = make_varlen([1], [0], [[]], torch.device("cpu"))
    one = torch.ones(1, 1)
    dt = native.selective_scan_varlen(
        torch.ones(1, channels), x[None], torch.zeros(channels, 1), one, one, None, None, None, True,
        torch.zeros(1, channels, 1), torch.tensor([0]), v,
    )  # fmt: skip
    torch.testing.assert_close(dt[0], F.softplus(x), rtol=2.5e-7, atol=0)


def test_a_fresh_sequence_never_reads_its_slot() -> None:
    u, delta, A, B, C, D, z, delta_bias, pool, slots, v = _inputs(48, 16, True)
    args = (u, delta, A, B, C, D, z, delta_bias, True)
    first_pool = pool.clone()
    first = native.selective_scan_varlen(*args, first_pool, slots, v)
    garbage = pool.clone()
    fresh = [b for b, (_, prefix, _) in enumerate(BATCH) if prefix == 0]
    garbage[slots[fresh]] = float("nan")
    again = native.selective_scan_varlen(*args, garbage, slots, v)
    assert torch.equal(first, again)
    assert torch.equal(garbage, first_pool)  # the NaN rows were overwritten by the same final states


@pytest.mark.parametrize("where", ["state slot -1", "state slot past the end", "capture slot past the end"])
def test_a_slot_outside_the_pool_is_refused_before_anything_is_written(where: str) -> None:
    u, delta, A, B, C, D, z, delta_bias, pool, slots, v = _inputs(48, 16, True)
    kept = pool.clone()
    if where == "capture slot past the end":
        caps = [[(o, SLOTS + 2 if o == 64 else s) for o, s in c] for c in v.captures]
        v = make_varlen(v.new_lens, v.prefix_lens, caps, torch.device("cpu"))
    else:
        slots = slots.clone()
        slots[0 if where == "state slot -1" else 3] = -1 if where == "state slot -1" else SLOTS
    with pytest.raises(ValueError, match="outside the pool's 40 slots"):
        native.selective_scan_varlen(u, delta, A, B, C, D, z, delta_bias, True, pool, slots, v)
    assert torch.equal(pool, kept)


def test_mismatched_shapes_are_refused() -> None:
    u, delta, A, B, C, D, z, delta_bias, pool, slots, v = _inputs(48, 16, True)
    with pytest.raises(ValueError, match="ssm_pool must be"):
        native.selective_scan_varlen(u, delta, A, B, C, D, z, delta_bias, True, pool[:, :, :8], slots, v)
    with pytest.raises(ValueError, match="B must be"):
        native.selective_scan_varlen(u, delta, A, B[:-1], C, D, z, delta_bias, True, pool, slots, v)


def test_dispatch_runs_the_native_kernel_for_float32_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIMAMBA_KERNELS", "native")
    u, delta, A, B, C, D, z, delta_bias, pool, slots, v = _inputs(48, 16, True)
    args = (u, delta, A, B, C, D, z, delta_bias, True)
    via_dispatch, direct = pool.clone(), pool.clone()
    got = dispatch.selective_scan_varlen(*args, via_dispatch, slots, v)
    want = native.selective_scan_varlen(*args, direct, slots, v)
    assert torch.equal(got, want) and torch.equal(via_dispatch, direct)
