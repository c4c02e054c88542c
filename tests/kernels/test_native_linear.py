"""The native CPU projection over panel-packed weights (kernels/native/linear.c): F.linear's product
for any shape, a row's result independent of its batch and of the thread count, bad input refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from himamba.kernels import dispatch
from himamba.kernels.native import build
from himamba.kernels.native import linear as native_linear

pytestmark = pytest.mark.skipif(
    build.native_build().library is None, reason=f"native kernels {build.native_build().detail}"
)


def _case(seed: int, rows: int, out: int, features: int, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, features, generator=gen)
    x = torch.randn(rows, features, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    return w, x, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    ("rows", "out", "features"),
    # One row (decode), a few (four panels a tile), a full tile and its ragged end, blocks of 64 rows;
    # widths on and off the 16-column panels, a single feature.
    [(1, 2320, 512), (3, 37, 19), (4, 16, 64), (8, 8192, 64), (13, 100, 700), (70, 33, 1000), (130, 48, 5), (2, 5, 1)],
)
def test_matches_f_linear(rows: int, out: int, features: int, bias: bool) -> None:
    w, x, b = _case(rows * 1000 + out, rows, out, features, bias)
    got = native_linear.linear(x, native_linear.pack(w), b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    assert got.shape == (rows, out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5 * features**0.5)


def test_a_row_is_the_same_alone_in_any_batch_and_on_any_threads() -> None:
    w, x, b = _case(7, 70, 200, 96, True)
    packed = native_linear.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = native_linear.linear(x, packed, b)
        torch.set_num_threads(max(2, threads))
        batched = native_linear.linear(x, packed, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, one_thread)
    for size in (1, 2, 5, 8, 9):  # every tile shape the batch could give a row
        for start in range(0, 70 - size, 13):
            assert torch.equal(native_linear.linear(x[start : start + size], packed, b), batched[start : start + size])


def test_strided_and_batched_inputs() -> None:
    w, x, b = _case(3, 24, 40, 32, False)
    packed = native_linear.pack(w)
    wide = torch.randn(24, 50)
    wide[:, 10:42] = x  # rows 50 floats apart, as a column slice of a fused projection is
    got = native_linear.linear(wide[:, 10:42], packed, b)
    assert torch.equal(got, native_linear.linear(x, packed, b))
    three_d = native_linear.linear(x.view(2, 12, 32), packed, b)
    assert three_d.shape == (2, 12, 40) and torch.equal(three_d.view(24, 40), got)
    transposed = native_linear.linear(x.t().contiguous().t(), packed, b)  # columns contiguous: copied first
    assert torch.equal(transposed, got)
    assert native_linear.linear(torch.empty(0, 32), packed, b).shape == (0, 40)


def test_no_input_features_gives_the_bias() -> None:
    bias = torch.randn(5)
    got = native_linear.linear(torch.empty(3, 0), native_linear.pack(torch.empty(5, 0)), bias)
    assert torch.equal(got, bias.expand(3, 5))


def test_bad_input_is_refused() -> None:
    packed = native_linear.pack(torch.randn(8, 4))
    with pytest.raises(ValueError, match="x has 5 features, the weight takes 4"):
        native_linear.linear(torch.randn(2, 5), packed, None)
    with pytest.raises(ValueError, match="bias must be float32 \\[8\\]"):
        native_linear.linear(torch.randn(2, 4), packed, torch.randn(7))
    with pytest.raises(ValueError, match="float32 CPU input"):
        native_linear.linear(torch.randn(2, 4, dtype=torch.float64), packed, None)
    with pytest.raises(ValueError, match="float32 CPU matrix"):
        native_linear.pack(torch.randn(8, 4, dtype=torch.bfloat16))


def test_dispatch_packs_float32_for_the_native_product_and_leaves_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(24, 16)
    assert isinstance(dispatch.pack_linear(w), dispatch.PanelWeight)
    assert dispatch.pack_linear(w.to(torch.bfloat16)) is None
    monkeypatch.setenv(dispatch.KERNELS_ENV, "reference")
    dispatch.kernels_mode.cache_clear()
    try:
        assert dispatch.pack_linear(w) is None
    finally:
        monkeypatch.delenv(dispatch.KERNELS_ENV)
        dispatch.kernels_mode.cache_clear()
