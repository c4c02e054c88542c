"""rms_norm / gated_rms_norm against float64 formulas, including where the dtype rounding happens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from himamba.kernels import gated_rms_norm, rms_norm

# Each test runs on the PyTorch reference and on the native CPU kernel (tests/kernels/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_kernels")


def naive_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def naive_gated(
    x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float, group: int
) -> torch.Tensor:
    u = x.double() if gate is None else x.double() * F.silu(gate.double())
    rows, width = u.shape
    out = torch.empty_like(u)
    for start in range(0, width, group):
        part = u[:, start : start + group]
        out[:, start : start + group] = part / torch.sqrt((part * part).mean(-1, keepdim=True) + eps)
    return weight.double() * out


@pytest.mark.parametrize("shape", [(1, 8), (7, 64), (2, 3, 48), (128, 512)])  # the last: one-reduction form
@pytest.mark.parametrize("multiply_in_float32", [False, True])
def test_rms_norm_matches_formula(shape: tuple[int, ...], multiply_in_float32: bool) -> None:
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g) * 3.0
    weight = torch.randn(shape[-1], generator=g)
    out = rms_norm(x, weight, 1e-6, multiply_in_float32)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_rms(x, weight, 1e-6), rtol=1e-5, atol=1e-6)


def test_rms_norm_eps_is_used() -> None:
    x = torch.full((1, 4), 1e-3)
    weight = torch.ones(4)
    torch.testing.assert_close(rms_norm(x, weight, 1.0).double(), naive_rms(x, weight, 1.0), rtol=1e-5, atol=1e-7)
    assert rms_norm(x, weight, 1.0).abs().max() < 1e-2


def test_rms_norm_rounding_point_in_bfloat16() -> None:
    """Granite/Mamba2 style casts the normalised x before the weight; NemotronH multiplies in float32."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 64, generator=g).bfloat16()
    weight = (torch.randn(64, generator=g) * 3).bfloat16()
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    llama_style = weight * normed.to(torch.bfloat16)
    float32_product = (weight.float() * normed).to(torch.bfloat16)
    assert not torch.equal(llama_style, float32_product)  # the two conventions differ in bf16
    default = rms_norm(x, weight, 1e-5)
    nemotron = rms_norm(x, weight, 1e-5, multiply_in_float32=True)
    assert default.dtype == nemotron.dtype == torch.bfloat16
    assert torch.equal(default, llama_style)
    assert torch.equal(nemotron, float32_product)


@pytest.mark.parametrize("width,group", [(16, 16), (48, 16), (64, 8), (30, 5), (4096, 512)])
@pytest.mark.parametrize("use_gate", [True, False])
def test_gated_rms_norm_matches_formula(width: int, group: int, use_gate: bool) -> None:
    g = torch.Generator().manual_seed(width + group)
    x = torch.randn(9, width, generator=g)
    gate = torch.randn(9, width, generator=g) if use_gate else None
    weight = torch.randn(width, generator=g)
    out = gated_rms_norm(x, gate, weight, 1e-5, group)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_gated(x, gate, weight, 1e-5, group), rtol=1e-5, atol=1e-6)


def test_gated_rms_norm_groups_are_independent() -> None:
    """Scaling one group's input must leave the other groups' outputs unchanged."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 32, generator=g)
    gate = torch.randn(3, 32, generator=g)
    weight = torch.ones(32)
    base = gated_rms_norm(x, gate, weight, 1e-6, 16)
    scaled = x.clone()
    scaled[:, :16] *= 100.0
    other = gated_rms_norm(scaled, gate, weight, 1e-6, 16)
    torch.testing.assert_close(other[:, 16:], base[:, 16:], rtol=0, atol=0)
    whole = gated_rms_norm(scaled, gate, weight, 1e-6, 32)
    assert not torch.allclose(whole[:, 16:], base[:, 16:])


def test_gated_rms_norm_bfloat16() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 32, generator=g)
    gate = torch.randn(4, 32, generator=g)
    weight = torch.randn(32, generator=g)
    out = gated_rms_norm(x.bfloat16(), gate.bfloat16(), weight.bfloat16(), 1e-5, 16)
    assert out.dtype == torch.bfloat16
    want = naive_gated(x.bfloat16(), gate.bfloat16(), weight.bfloat16(), 1e-5, 16)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def test_bad_input_raises_value_error() -> None:
    x = torch.randn(2, 12)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(11), 1e-6)
    with pytest.raises(ValueError, match="group_size"):
        gated_rms_norm(x, None, torch.ones(12), 1e-6, 5)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, torch.randn(2, 6), torch.ones(12), 1e-6, 6)
