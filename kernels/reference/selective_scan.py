"""Mamba1's selective scan (Jamba, Falcon-Mamba): the prefill scan and one decode step.

Per channel d with state h[d] [N] (A [D, N] diagonal, B_t and C_t [N] shared by all channels):

    dt_t = softplus(delta_t + delta_bias)                     (softplus optional)
    h_t  = exp(dt_t * A) * h_{t-1} + dt_t * u_t * B_t          # elementwise over [D, N]
    y_t  = (h_t · C_t + D * u_t) * silu(z_t)                   (D and z optional)

Layout is token-major like the rest of `himamba.kernels` (transformers' Mamba1 code is
channel-major, [Bt, D, L]): u, delta, z, y [Bt, L, D]; B, C [Bt, L, N]; state [Bt, D, N].

The decay exp(dt_t * A) differs per (d, n), so the Mamba2 trick of a (Q x Q) decay matrix per
head does not apply. Two forms are kept, chosen per call:
  - the loop: one step per token on the [Bt, D, N] state (4 small ops per token);
  - the chunked form: the recurrence over Q = sqrt(L / 2) positions of all L / Q chunks at once
    (from zero states, to get each chunk's own contribution), the boundary states carried across
    chunks, then every chunk again from its true start state to emit y: 2Q + L/Q steps on a
    [Bt, L/Q, D, N] state, twice the arithmetic of the loop.
Measured on the 2-core CPU (one thread, interleaved runs, N = 16): with D*N = 4096 per step the
chunked form is 1.2-1.5x faster for L >= 256 (the loop is bound by per-op overhead); with
D*N = 32768 (L = 2048: 304 vs 646 ms) and D*N = 131072 (Jamba's size; L = 256: 79 vs 208 ms)
the loop is 2-2.6x faster because the chunked form's extra arithmetic dominates. So the chunked
form is used only when Bt*D*N <= 8192 and L >= 64.
Arithmetic is float32 whatever the input dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..varlen import Varlen
from .ssd import ScanResult
from .state_rows import check_state_indices, update_rows_at

# The chunked form pays off only while each step is overhead-bound: see the module docstring.
_CHUNKED_MIN_LEN = 64
_CHUNKED_MAX_STEP_ELEMENTS = 8192


def _process_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool) -> Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt) if dt_softplus else dt


def _check_params(channels: int, A: Tensor, D: Tensor | None, bias: Tensor | None, bias_name: str) -> int:
    """Validate A [D, N], D [D] and the dt bias [D]; return N."""
    if A.dim() != 2 or A.shape[0] != channels:
        raise ValueError(f"A must be [D={channels}, N], got {tuple(A.shape)}")
    for name, t in (("D", D), (bias_name, bias)):
        if t is not None and tuple(t.shape) != (channels,):
            raise ValueError(f"{name} must be [D={channels}], got {tuple(t.shape)}")
    return A.shape[1]


def _run(state: Tensor, dt: Tensor, dtu: Tensor, A: Tensor, B: Tensor, C: Tensor | None) -> Tensor | None:
    """Advance `state` [..., D, N] in place over the steps of dt/dtu [..., S, D] and B/C [..., S, N].

    Returns the outputs C_t · h_t [..., S, D] when C is given.
    """
    steps = dt.shape[-2]
    decay = torch.empty_like(state)
    ys = []
    for t in range(steps):
        torch.mul(dt[..., t, :, None], A, out=decay)
        state.mul_(decay.exp_()).addcmul_(dtu[..., t, :, None], B[..., t, None, :])
        if C is not None:
            ys.append(state @ C[..., t, :, None])
    return None if C is None else torch.cat(ys, dim=-1).transpose(-1, -2)


def _scan_chunked(state: Tensor, dt: Tensor, dtu: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
    """The three-pass chunked scan; `state` [Bt, D, N] becomes the final state. Returns y [Bt, L, D]."""
    batch, length, channels = dt.shape
    size = max(1, math.isqrt(length // 2))
    pad = (-length) % size
    chunks = (length + pad) // size
    # Padded steps have dt = 0: no decay and no input, so they leave the state unchanged.
    dt_c, dtu_c = (F.pad(t, (0, 0, 0, pad)).view(batch, chunks, size, channels) for t in (dt, dtu))
    B_c, C_c = (F.pad(t, (0, 0, 0, pad)).view(batch, chunks, size, -1) for t in (B, C))

    # 1. What each chunk adds to the state, from zero.
    local = state.new_zeros(batch, chunks, *state.shape[1:])
    _run(local, dt_c, dtu_c, A, B_c, None)
    # 2. The start state of every chunk.
    chunk_decay = (dt_c.sum(2)[..., None] * A).exp_()  # [Bt, chunks, D, N]
    starts = torch.empty_like(local)
    for c in range(chunks):
        starts[:, c] = state
        state.mul_(chunk_decay[:, c]).add_(local[:, c])
    # 3. Every chunk again from its true start, now reading out y.
    y = _run(starts, dt_c, dtu_c, A, B_c, C_c)
    assert y is not None
    return y.reshape(batch, chunks * size, channels)[:, :length]


def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = True,
    initial_state: Tensor | None = None,
) -> ScanResult:
    """Mamba1 scan over u [Bt, L, D] with delta [Bt, L, D] (raw), A [D, N] (negative), B/C [Bt, L, N].

    D [D] skip, z [Bt, L, D] gate (y * silu(z)), delta_bias [D]. initial_state [Bt, D, N] (None:
    zeros) is not modified. Returns y [Bt, L, D] in u's dtype and the final state in float32 (or the
    initial state's dtype). Splitting a sequence and chaining `final_state` gives the same result.
    """
    if u.dim() != 3:
        raise ValueError(f"u must be [Bt, L, D], got {tuple(u.shape)}")
    batch, length, channels = u.shape
    if delta.shape != u.shape:
        raise ValueError(f"delta must have u's shape {tuple(u.shape)}, got {tuple(delta.shape)}")
    if z is not None and z.shape != u.shape:
        raise ValueError(f"z must have u's shape {tuple(u.shape)}, got {tuple(z.shape)}")
    state_size = _check_params(channels, A, D, delta_bias, "delta_bias")
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != (batch, length, state_size):
            raise ValueError(f"{name} must be [Bt={batch}, L={length}, N={state_size}], got {tuple(t.shape)}")
    state_shape = (batch, channels, state_size)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must be {list(state_shape)}, got {tuple(initial_state.shape)}")
    state_dtype = torch.float32 if initial_state is None else initial_state.dtype

    u32 = u.float()
    dt = _process_dt(delta, delta_bias, delta_softplus)
    A32, B32, C32 = A.float(), B.float(), C.float()
    if initial_state is None:
        state = u32.new_zeros(state_shape)
    else:
        state = initial_state.to(torch.float32, copy=True).contiguous()
    if length == 0:
        y = u32.new_empty(u.shape)
    elif length >= _CHUNKED_MIN_LEN and state.numel() <= _CHUNKED_MAX_STEP_ELEMENTS:
        y = _scan_chunked(state, dt, dt * u32, A32, B32, C32)
    else:
        y = _run(state, dt, dt * u32, A32, B32, C32)
        assert y is not None
    if D is not None:
        y = y + D.float() * u32
    if z is not None:
        y = y * F.silu(z.float())
    return ScanResult(y.to(u.dtype), state.to(state_dtype))


def check_varlen_args(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    ssm_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
) -> int:
    """Raise ValueError unless the arguments of a varlen scan (u, delta, z [T, D] packed as `v` says;
    B, C [T, N]; the pool [slots, D, N]; one slot per sequence) fit together; return N."""
    if u.dim() != 2 or u.shape[0] != v.num_tokens:
        raise ValueError(f"u must be [T={v.num_tokens}, D], got {tuple(u.shape)}")
    total, channels = u.shape
    for name, t in (("delta", delta), ("z", z)):
        if t is not None and t.shape != u.shape:
            raise ValueError(f"{name} must have u's shape {tuple(u.shape)}, got {tuple(t.shape)}")
    state_size = _check_params(channels, A, D, delta_bias, "delta_bias")
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != (total, state_size):
            raise ValueError(f"{name} must be [T={total}, N={state_size}], got {tuple(t.shape)}")
    if ssm_pool.dim() != 3 or tuple(ssm_pool.shape[1:]) != (channels, state_size):
        raise ValueError(f"ssm_pool must be [slots, D={channels}, N={state_size}], got {tuple(ssm_pool.shape)}")
    if state_slots.dim() != 1 or state_slots.shape[0] != v.num_seqs:
        raise ValueError(f"state_slots must be [{v.num_seqs}], got {tuple(state_slots.shape)}")
    return state_size


def check_update_args(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
) -> None:
    """Raise ValueError unless the arguments of `selective_state_update_mamba1` fit together (every
    implementation checks them so)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [Bt, D], got {tuple(x.shape)}")
    batch, channels = x.shape
    for name, t in (("dt", dt), ("z", z)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name} must have x's shape {tuple(x.shape)}, got {tuple(t.shape)}")
    state_size = _check_params(channels, A, D, dt_bias, "dt_bias")
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != (batch, state_size):
            raise ValueError(f"{name} must be [Bt={batch}, N={state_size}], got {tuple(t.shape)}")
    if tuple(state.shape) != (batch, channels, state_size):
        raise ValueError(f"state must be [Bt={batch}, D={channels}, N={state_size}], got {tuple(state.shape)}")


def selective_state_update_mamba1(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    state_batch_indices: Tensor | None = None,
) -> Tensor:
    """One decode step: state [Bt, D, N], x, dt, z [Bt, D], A [D, N], B/C [Bt, N]; returns y [Bt, D].

    Mutates `state` in place to the state after this token (computed in float32, stored in the
    state's dtype); y is read from the float32 state and returned in x's dtype. With
    `state_batch_indices` [Bt] (int32/int64), `state` is the whole pool [slots, D, N] and batch row b
    updates its row `state_batch_indices[b]`.
    """
    if state_batch_indices is not None:
        check_update_args(check_state_indices(state, x.shape[0], state_batch_indices), x, dt, A, B, C, D, z, dt_bias)
        return update_rows_at(
            state,
            state_batch_indices,
            lambda rows: selective_state_update_mamba1(rows, x, dt, A, B, C, D, z, dt_bias, dt_softplus),
        )
    check_update_args(state, x, dt, A, B, C, D, z, dt_bias)
    x32 = x.float()
    dt32 = _process_dt(dt, dt_bias, dt_softplus)
    new = state.float() * (dt32[..., None] * A.float()).exp() + (dt32 * x32)[..., None] * B.float()[:, None, :]
    state.copy_(new)
    y = (new @ C.float()[..., None]).squeeze(-1)
    if D is not None:
        y = y + D.float() * x32
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)
