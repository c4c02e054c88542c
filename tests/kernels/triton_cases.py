"""Cases comparing every Triton twin with its reference on random CPU inputs (run by `triton_run.py`).

Importing this module imports neither triton nor a twin: the pytest process reads `CASES` for the
test ids while the cases themselves run in a subprocess under TRITON_INTERPRET=1. Sizes are small
(the interpreter runs each program in numpy) but cover the shapes that matter: page and chunk
boundaries, ragged batches, GQA ratios, head dims 64 and 128, strided views of the worker's
projections and pool rows as inputs.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


class Case(NamedTuple):
    """One comparison of a twin with its reference; `run` returns how many tensors it compared."""

    id: str
    fn: Callable[..., int]
    params: dict[str, Any]

    def run(self) -> int:
        return self.fn(**self.params)


CASES: list[Case] = []


def case(**grid: list[Any]) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Register `fn` once per combination of the given parameter values."""

    def register(fn: Callable[..., int]) -> Callable[..., int]:
        names = list(grid)
        for values in itertools.product(*grid.values()):
            params = dict(zip(names, values))
            label = ",".join(f"{k}={getattr(v, 'name', None) or str(v).replace('torch.', '')}" for k, v in params.items())
            CASES.append(Case(f"{fn.__name__}[{label}]", fn, params))
        return fn

    return register


def twin(module: str) -> Any:
    return importlib.import_module(f"himamba.kernels.triton.{module}")


def ref(module: str) -> Any:
    return importlib.import_module(f"himamba.kernels.reference.{module}")


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> int:
    """assert_close at the tolerance of `dtype` (times `scale`); also the dtype and shape. Returns 1."""
    rtol, atol = TOL[dtype]
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    torch.testing.assert_close(got, want, rtol=rtol * scale, atol=atol * scale)
    return 1


def columns(t: torch.Tensor, extra: int, seed: int) -> torch.Tensor:
    """t as a strided view: the leading columns of a wider 2-d buffer, as projections' splits are."""
    wide = rand(t.shape[0], t.shape[1] + extra, seed=seed, dtype=t.dtype)
    wide[:, : t.shape[1]] = t
    return wide[:, : t.shape[1]]


# ----------------------------------------------------------------------------------------- norm


@case(shape=[(5, 64), (3, 4, 96), (2, 1000)], dtype=[torch.float32, torch.float16], in_f32=[False, True])
def rms_norm(shape: tuple[int, ...], dtype: torch.dtype, in_f32: bool) -> int:
    x, w = rand(*shape, seed=1, dtype=dtype), rand(shape[-1], seed=2, dtype=dtype)
    if len(shape) == 2:
        x = columns(x, 7, seed=3)
    want = ref("norm").rms_norm(x, w, 1e-5, in_f32)
    return check(twin("norm").rms_norm(x, w, 1e-5, in_f32), want, dtype)


@case(group=[32, 128], gate=[True, False], dtype=[torch.float32, torch.float16])
def gated_rms_norm(group: int, gate: bool, dtype: torch.dtype) -> int:
    x = columns(rand(6, 128, seed=1, dtype=dtype), 40, seed=2)
    z = columns(rand(6, 128, seed=3, dtype=dtype), 9, seed=4) if gate else None
    w = rand(128, seed=5, dtype=dtype)
    want = ref("norm").gated_rms_norm(x, z, w, 1e-6, group)
    return check(twin("norm").gated_rms_norm(x, z, w, 1e-6, group), want, dtype)


# ------------------------------------------------------------------------------------------- conv


@case(length=[1, 2, 11, 40], width=[4], bias=[True], init=[True, False], time_major=[True, False])
def causal_conv1d(length: int, width: int, bias: bool, init: bool, time_major: bool) -> int:
    return _conv(length, width, bias, init, time_major, "silu", torch.float32)


@case(width=[2, 3], activation=[None, "silu"], dtype=[torch.float32, torch.float16])
def causal_conv1d_widths(width: int, activation: str | None, dtype: torch.dtype) -> int:
    return _conv(37, width, False, True, True, activation, dtype)


def _conv(length: int, width: int, bias: bool, init: bool, time_major: bool, act: str | None, dtype) -> int:
    batch, channels = 2, 72
    if time_major:
        # As the Mamba2 layer passes it: the xBC columns of the in-projection, seen as [1, D, L].
        x = rand(batch, length, channels + 10, seed=1, dtype=dtype)[:, :, :channels].transpose(1, 2)
    else:
        x = rand(batch, channels, length, seed=1, dtype=dtype)
    weight = rand(channels, width, seed=3, dtype=dtype)
    b = rand(channels, seed=4, dtype=dtype) if bias else None
    state = rand(batch, channels, width - 1, seed=5, dtype=dtype) if init else None
    want = ref("conv1d").causal_conv1d(x, weight, b, state, act)
    got = twin("conv1d").causal_conv1d(x, weight, b, state, act)
    assert type(got) is type(want)
    return check(got.out, want.out, dtype) + check(got.final_state, want.final_state, dtype)


@case(bias=[True, False], rows=["pool", "gathered"], dtype=[torch.float32, torch.float16])
def causal_conv1d_update(bias: bool, rows: str, dtype: torch.dtype) -> int:
    batch, channels, width = 3, 72, 4
    x = columns(rand(batch, channels, seed=1, dtype=dtype), 33, seed=2)  # the xBC split of a projection
    pool = rand(8, channels, width - 1, seed=3, dtype=dtype)
    weight, b = rand(channels, width, seed=4, dtype=dtype), rand(channels, seed=5, dtype=dtype) if bias else None
    # Decode updates pool rows in place (consecutive slots) or a gathered copy.
    state = pool.narrow(0, 2, batch) if rows == "pool" else pool.index_select(0, torch.tensor([5, 0, 7]))
    want_state = state.clone()
    want = ref("conv1d").causal_conv1d_update(x, want_state, weight, b)
    got = twin("conv1d").causal_conv1d_update(x, state, weight, b)
    return check(got, want, dtype) + check(state, want_state, dtype)
