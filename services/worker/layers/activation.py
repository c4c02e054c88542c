"""Activation functions by their HF config names (`hidden_act`, `mlp_hidden_act`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _relu2_(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x, inplace=True).square_()


def _silu_(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x, inplace=True)


def _relu_(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x, inplace=True)


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function HF's ACT2FN maps `name` to, for the names our model families use."""
    match name:
        case "relu2":
            return _relu2
        case "silu" | "swish":
            return F.silu
        case "relu":
            return F.relu
        case "gelu":
            return F.gelu
        case "gelu_pytorch_tanh" | "gelu_new":
            return _gelu_tanh
        case _:
            raise ValueError(
                f"unsupported activation {name!r} (known: relu2, silu, swish, relu, gelu, gelu_pytorch_tanh)"
            )


def inplace_activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """`activation_fn(name)` computed in the tensor it is given, for a fresh tensor the caller owns
    (a projection's output): bit-identical results, one temporary fewer. Activations without an
    in-place form fall back to `activation_fn`'s."""
    match name:
        case "relu2":
            return _relu2_
        case "silu" | "swish":
            return _silu_
        case "relu":
            return _relu_
        case _:
            return activation_fn(name)
