"""causal_conv1d / causal_conv1d_update against a per-token float64 specification."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from himamba.kernels import ConvResult, causal_conv1d, causal_conv1d_update

# Each test runs on the PyTorch reference and on the native CPU kernel (tests/kernels/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_kernels")


def naive_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor | None, activation: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification: out[t] = act(bias + sum_k w[k] * input[t - (K-1) + k]), in float64."""
    batch, channels, length = x.shape
    width = weight.shape[1]
    if state is None:
        state = torch.zeros(batch, channels, width - 1, dtype=torch.float64)
    full = torch.cat([state.double(), x.double()], dim=-1)
    w = weight.double()
    out = torch.empty(batch, channels, length, dtype=torch.float64)
    for t in range(length):
        acc = (full[:, :, t : t + width] * w).sum(-1)
        if bias is not None:
            acc = acc + bias.double()
        out[:, :, t] = F.silu(acc) if activation == "silu" else acc
    return out, full[:, :, full.shape[-1] - (width - 1) :]


def make(batch: int, channels: int, width: int, length: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, length, generator=g)
    weight = torch.randn(channels, width, generator=g)
    bias = torch.randn(channels, generator=g)
    state = torch.randn(batch, channels, width - 1, generator=g)
    return x, weight, bias, state


@pytest.mark.parametrize("batch,channels,width", [(1, 4, 4), (2, 6, 4), (3, 5, 2), (2, 3, 1)])
@pytest.mark.parametrize("length", [1, 2, 7, 33])
@pytest.mark.parametrize("with_state", [False, True])
def test_causal_conv1d_matches_spec(batch: int, channels: int, width: int, length: int, with_state: bool) -> None:
    x, weight, bias, state = make(batch, channels, width, length, seed=length * 10 + width)
    init = state if with_state else None
    result = causal_conv1d(x, weight, bias, init, "silu")
    want_out, want_state = naive_conv(x, weight, bias, init, "silu")
    assert isinstance(result, ConvResult)
    assert result.out.shape == (batch, channels, length) and result.out.dtype == torch.float32
    assert result.final_state.shape == (batch, channels, width - 1)
    torch.testing.assert_close(result.out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.final_state.double(), want_state, rtol=0, atol=0)


@pytest.mark.parametrize("use_bias", [False, True])
def test_causal_conv1d_without_activation_or_bias(use_bias: bool) -> None:
    x, weight, bias, state = make(2, 4, 4, 9, seed=3)
    b = bias if use_bias else None
    out = causal_conv1d(x, weight, b, state, None).out
    want, _ = naive_conv(x, weight, b, state, None)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert (out < 0).any()  # no silu applied


def test_short_segment_state_keeps_older_inputs() -> None:
    """L < K-1: the final state is the tail of (old state, x), part of it from the old state."""
    x, weight, bias, state = make(2, 3, 4, 1, seed=5)
    final = causal_conv1d(x, weight, bias, state).final_state
    torch.testing.assert_close(final[:, :, :2], state[:, :, 1:], rtol=0, atol=0)
    torch.testing.assert_close(final[:, :, 2], x[:, :, 0], rtol=0, atol=0)


@pytest.mark.parametrize("split", [1, 2, 5, 20])
def test_split_equals_whole(split: int) -> None:
    x, weight, bias, state = make(2, 5, 4, 21, seed=split)
    whole = causal_conv1d(x, weight, bias, state)
    first = causal_conv1d(x[:, :, :split], weight, bias, state)
    second = causal_conv1d(x[:, :, split:], weight, bias, first.final_state)
    torch.testing.assert_close(torch.cat([first.out, second.out], dim=-1), whole.out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(second.final_state, whole.final_state, rtol=0, atol=0)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_prefill_then_decode_steps_equals_longer_prefill(width: int) -> None:
    x, weight, bias, state = make(3, 6, width, 12, seed=width)
    prefix, steps = 7, 5
    with torch.inference_mode():
        whole = causal_conv1d(x, weight, bias, state)
        conv_state = causal_conv1d(x[:, :, :prefix], weight, bias, state).final_state.clone()
        outs = [causal_conv1d_update(x[:, :, prefix + i], conv_state, weight, bias) for i in range(steps)]
    torch.testing.assert_close(torch.stack(outs, dim=-1), whole.out[:, :, prefix:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(conv_state, whole.final_state, rtol=0, atol=0)


def test_update_mutates_state_in_place_only() -> None:
    x, weight, bias, state = make(2, 4, 4, 1, seed=9)
    step = x[:, :, 0].clone()
    conv_state = state.clone()
    ptr = conv_state.data_ptr()
    out = causal_conv1d_update(step, conv_state, weight, bias, "silu")
    want, _ = naive_conv(step[:, :, None], weight, bias, state, "silu")
    torch.testing.assert_close(out.double(), want[:, :, 0], rtol=1e-6, atol=1e-6)
    assert conv_state.data_ptr() == ptr
    torch.testing.assert_close(conv_state, torch.cat([state[:, :, 1:], step[:, :, None]], dim=-1), rtol=0, atol=0)
    torch.testing.assert_close(step, x[:, :, 0], rtol=0, atol=0)


def test_bfloat16_preserves_dtype_and_stays_close() -> None:
    x, weight, bias, state = make(2, 8, 4, 10, seed=11)
    result = causal_conv1d(x.bfloat16(), weight.bfloat16(), bias.bfloat16(), state.bfloat16())
    assert result.out.dtype == torch.bfloat16 and result.final_state.dtype == torch.bfloat16
    want, _ = naive_conv(x, weight, bias, state, "silu")
    torch.testing.assert_close(result.out.double(), want, rtol=5e-2, atol=1e-1)
    conv_state = state.bfloat16()
    out = causal_conv1d_update(x[:, :, 0].bfloat16(), conv_state, weight.bfloat16(), bias.bfloat16())
    assert out.dtype == torch.bfloat16 and conv_state.dtype == torch.bfloat16


def test_bad_input_raises_value_error() -> None:
    x, weight, bias, state = make(2, 4, 4, 3, seed=1)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(x, weight, bias, state, "gelu")
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, weight, bias, state[:, :, :2])
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, weight[:3], bias, state)
    with pytest.raises(ValueError, match="bias"):
        causal_conv1d(x, weight, bias[:2], state)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(x[:, :, 0], state[:1], weight, bias)
