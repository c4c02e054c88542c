"""Mamba2's selective state space recurrence: the chunked SSD scan (prefill) and one decode step.

Per head h (head dim P, state size N; B and C are shared by the H/G heads of a group):

    dt_t = clamp(softplus(dt_raw_t + dt_bias), dt_limit)
    h_t  = exp(dt_t * A) * h_{t-1} + dt_t * (x_t ⊗ B_t)        # h_t: [P, N]
    y_t  = h_t · C_t + D * x_t                                  # y_t: [P]

`ssd_scan` evaluates this with the state space duality: inside a chunk of Q tokens the
recurrence is a masked (Q x Q) attention-like product, and only the chunk boundary states are
carried by a short loop over chunks. Arithmetic is float32 whatever the input dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .decay import segment_decay


class ScanResult(NamedTuple):
    """Outputs of a scan over a segment and the recurrent state after its last token.

    Shared by the Mamba2 scan (`ssd_scan`) and the Mamba1 scan (`selective_scan`); the shapes below
    are Mamba2's, Mamba1's are y [Bt, L, D] and final_state [Bt, D, N].
    """

    y: Tensor  # [Bt, L, H, P], dtype of x
    final_state: Tensor  # [Bt, H, P, N], float32 (or the dtype of the given initial state)


def _process_dt(
    dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]
) -> Tensor:
    low, high = dt_limit
    if not low <= high:
        raise ValueError(f"dt_limit must be (low, high) with low <= high, got {dt_limit}")
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if (low, high) != (0.0, math.inf):
        dt = dt.clamp(low, high)
    return dt


def _check_heads(
    x: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, dt_bias: Tensor | None
) -> int:
    """Validate the head/group layout shared by both entry points; return heads per group."""
    heads = x.shape[-2]
    groups = B.shape[-2]
    if groups < 1 or heads % groups != 0:
        raise ValueError(f"B/C groups ({groups}) must divide the number of heads ({heads})")
    if C.shape != B.shape:
        raise ValueError(f"C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t is not None and tuple(t.shape) != (heads,):
            raise ValueError(f"{name} must be [H={heads}], got {tuple(t.shape)}")
    return heads // groups


def ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_state: Tensor | None = None,
) -> ScanResult:
    """Chunked scan over x [Bt, L, H, P] with dt [Bt, L, H], A [H], B/C [Bt, L, G, N].

    initial_state [Bt, H, P, N] (None: zeros) is the state before the first token; it is not
    modified. Splitting a sequence and chaining `final_state` gives the same result as one call.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be [Bt, L, H, P], got {tuple(x.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length, heads, head_dim = x.shape
    if tuple(dt.shape) != (batch, length, heads):
        raise ValueError(f"dt must be [Bt={batch}, L={length}, H={heads}], got {tuple(dt.shape)}")
    if B.dim() != 4 or B.shape[:2] != (batch, length):
        raise ValueError(f"B must be [Bt={batch}, L={length}, G, N], got {tuple(B.shape)}")
    rep = _check_heads(x, A, B, C, D, dt_bias)
    groups, state_size = B.shape[2], B.shape[3]
    state_shape = (batch, heads, head_dim, state_size)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must be {list(state_shape)}, got {tuple(initial_state.shape)}")
    state_dtype = torch.float32 if initial_state is None else initial_state.dtype
    if length == 0:
        final = x.new_zeros(state_shape, dtype=state_dtype) if initial_state is None else initial_state.clone()
        return ScanResult(x.new_empty(x.shape), final)

    dt = _process_dt(dt, dt_bias, dt_softplus, dt_limit)
    x32 = x.float()
    pad = (-length) % chunk_size
    # Padded tokens get dt = 0 (after softplus/bias), i.e. no decay and no input: the final state
    # is that of the last real token.
    xdt = F.pad(x32 * dt[..., None], (0, 0, 0, 0, 0, pad))
    dA = F.pad(dt * A.float(), (0, 0, 0, pad))
    Bc = F.pad(B.float(), (0, 0, 0, 0, 0, pad))
    Cc = F.pad(C.float(), (0, 0, 0, 0, 0, pad))
    chunks, q = (length + pad) // chunk_size, chunk_size
    # b batch, c chunk, l/s positions in a chunk, g group, r head within group, p head dim, n state.
    xdt = xdt.reshape(batch, chunks, q, groups, rep, head_dim)
    Bc = Bc.reshape(batch, chunks, q, groups, state_size)
    Cc = Cc.reshape(batch, chunks, q, groups, state_size)
    dA = dA.reshape(batch, chunks, q, heads).transpose(2, 3)  # [b, c, h, l]

    decay = segment_decay(dA)  # [b, c, h, l, s]
    decay_from_start = dA.cumsum(-1).exp()  # [b, c, h, l]: exp(sum_{k<=l} dA_k)
    decay_to_end = decay[..., -1, :]  # [b, c, h, s]: exp(sum_{k>s} dA_k)
    chunk_decay = decay_from_start[..., -1].view(batch, chunks, groups, rep)

    # 1. Within-chunk outputs: the recurrence unrolled as a causal, decay-weighted C·B product.
    cb = torch.einsum("bclgn,bcsgn->bcgls", Cc, Bc)
    scores = cb.unsqueeze(3) * decay.view(batch, chunks, groups, rep, q, q)
    y = torch.einsum("bcgrls,bcsgrp->bclgrp", scores, xdt)

    # 2. Each chunk's contribution to the state at its end, starting from zero.
    to_end = decay_to_end.transpose(2, 3).reshape(batch, chunks, q, groups, rep, 1)
    local_states = torch.einsum("bclgn,bclgrp->bcgrpn", Bc, xdt * to_end)

    # 3. Carry the boundary states across chunks (the only sequential part).
    if initial_state is None:
        state = x32.new_zeros(batch, groups, rep, head_dim, state_size)
    else:
        state = initial_state.float().reshape(batch, groups, rep, head_dim, state_size)
    starts = []
    for c in range(chunks):
        starts.append(state)
        state = state * chunk_decay[:, c, :, :, None, None] + local_states[:, c]
    start_states = torch.stack(starts, dim=1)  # [b, c, g, r, p, n]

    # 4. What the state entering each chunk contributes to the chunk's outputs.
    from_start = decay_from_start.transpose(2, 3).reshape(batch, chunks, q, groups, rep, 1)
    y = y + torch.einsum("bclgn,bcgrpn->bclgrp", Cc, start_states) * from_start

    y = y.reshape(batch, chunks * q, heads, head_dim)[:, :length]
    if D is not None:
        y = y + D.float()[:, None] * x32
    final_state = state.reshape(state_shape).to(state_dtype)
    return ScanResult(y.to(x.dtype), final_state)


def selective_state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> Tensor:
    """One decode step: state [Bt, H, P, N], x [Bt, H, P], dt [Bt, H], B/C [Bt, G, N]; returns y [Bt, H, P].

    Mutates `state` in place to the state after this token (computed in float32, stored in the
    state's dtype); y is read from the float32 state, before that rounding, and returned in x's dtype.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [Bt, H, P], got {tuple(x.shape)}")
    batch, heads, head_dim = x.shape
    if tuple(dt.shape) != (batch, heads):
        raise ValueError(f"dt must be [Bt={batch}, H={heads}], got {tuple(dt.shape)}")
    if B.dim() != 3 or B.shape[0] != batch:
        raise ValueError(f"B must be [Bt={batch}, G, N], got {tuple(B.shape)}")
    rep = _check_heads(x, A, B, C, D, dt_bias)
    groups, state_size = B.shape[1], B.shape[2]
    if tuple(state.shape) != (batch, heads, head_dim, state_size):
        raise ValueError(
            f"state must be [Bt={batch}, H={heads}, P={head_dim}, N={state_size}], got {tuple(state.shape)}"
        )

    dt = _process_dt(dt, dt_bias, dt_softplus, dt_limit)
    x32 = x.float()
    decay = (dt * A.float()).exp().view(batch, groups, rep, 1, 1)
    xdt = (x32 * dt[..., None]).view(batch, groups, rep, head_dim, 1)
    b32 = B.float().reshape(batch, groups, 1, 1, state_size)
    if state.dtype == torch.float32 and state.is_contiguous():
        # In place: allocating a fresh state-sized temporary costs more than the arithmetic.
        new = state.view(batch, groups, rep, head_dim, state_size)
        new.mul_(decay).addcmul_(xdt, b32)
    else:
        new = state.float().reshape(batch, groups, rep, head_dim, state_size) * decay + xdt * b32
        state.copy_(new.view(state.shape))
    y = torch.einsum("bgrpn,bgn->bgrp", new, C.float()).reshape(batch, heads, head_dim)
    if D is not None:
        y = y + D.float()[:, None] * x32
    return y.to(x.dtype)
