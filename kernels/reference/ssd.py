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

from ..varlen import Varlen
from .state_rows import check_state_indices, update_rows_at


class ScanResult(NamedTuple):
    """Outputs of a scan over a segment and the recurrent state after its last token.

    Shared by the Mamba2 scan (`ssd_scan`) and the Mamba1 scan (`selective_scan`); the shapes below
    are Mamba2's, Mamba1's are y [Bt, L, D] and final_state [Bt, D, N].
    """

    y: Tensor  # [Bt, L, H, P], dtype of x
    final_state: Tensor  # [Bt, H, P, N], float32 (or the dtype of the given initial state)


def _process_dt(dt: Tensor, dt_bias: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]) -> Tensor:
    check_dt_limit(dt_limit)
    low, high = dt_limit
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if (low, high) != (0.0, math.inf):
        dt = dt.clamp(low, high)
    return dt


def _check_heads(x: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, dt_bias: Tensor | None) -> int:
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


# exp() of float32 arguments below about -87.3 (results under the smallest normal float) takes a
# slow path on CPU, ten times slower than the rest; a chunk's decays reach that range routinely.
# Clamping there changes a result of at most 1.2e-38 into 1.6e-38, far below float32 resolution of
# any sum it enters.
_EXP_FLOOR = -87.0
# exp() stays finite below about 88.7: the decay entries a caller masks to zero are clamped here, so
# that the mask multiplies a finite number (0 * inf would be nan). Unmasked exponents are <= 0 for
# the decays every model has (dt >= 0, A < 0); a positive one this large would overflow anyway.
_EXP_CEIL = 80.0
# The fastest chunk length of `ssd_scan` on CPU. Measured on AVX2 (the PyTorch reference: 64 beat 32 and
# 128 by 5-30%), then on AVX-512 with the native scan (chunk_scan.c, whose within-chunk work grows with
# the chunk): 32 beats 64 by 15-30% (512 tokens 2.1 against 3.1 ms, 2048 9.4 against 11.2 ms on two
# threads), and the reference is as fast or faster at 32.
_CPU_CHUNK = 32


def _exp(t: Tensor) -> Tensor:
    """exp of a fresh tensor, in place, with arguments clamped at _EXP_FLOOR."""
    return t.clamp_min_(_EXP_FLOOR).exp_()


def _decay_to_later(log_decay: Tensor) -> Tensor:
    """[..., Q] log decays -> [..., Q(s), Q(l)]: exp(a_{s+1} + ... + a_l) for l >= s, and a finite
    value for l < s (callers mask those), with the exponents clamped to [_EXP_FLOOR, _EXP_CEIL].

    The transpose of `decay.segment_decay`, laid out so each token's row runs along the contiguous
    last dim. Exponents are differences of a float64 running sum, rounded once to float32: the
    same float32 values as summing the masked increments (torch's CPU cumsum adds float32 in
    float64), in three passes over the [Q, Q] tensors instead of five.
    """
    q = log_decay.shape[-1]
    running = log_decay.double().cumsum(-1)
    seg = log_decay.new_empty(*log_decay.shape, q)
    torch.sub(running.unsqueeze(-2), running.unsqueeze(-1), out=seg)
    return seg.clamp_(_EXP_FLOOR, _EXP_CEIL).exp_()


def check_scan_args(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None,
    dt_bias: Tensor | None,
    initial_state: Tensor | None,
) -> None:
    """Raise ValueError unless the arguments of `ssd_scan` fit together (every implementation checks them so)."""
    if x.dim() != 4:
        raise ValueError(f"x must be [Bt, L, H, P], got {tuple(x.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length, heads, head_dim = x.shape
    if tuple(dt.shape) != (batch, length, heads):
        raise ValueError(f"dt must be [Bt={batch}, L={length}, H={heads}], got {tuple(dt.shape)}")
    if B.dim() != 4 or B.shape[:2] != (batch, length):
        raise ValueError(f"B must be [Bt={batch}, L={length}, G, N], got {tuple(B.shape)}")
    _check_heads(x, A, B, C, D, dt_bias)
    state_shape = (batch, heads, head_dim, B.shape[3])
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must be {list(state_shape)}, got {tuple(initial_state.shape)}")


def check_varlen_scan_args(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None,
    dt_bias: Tensor | None,
    ssm_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
) -> int:
    """As `check_scan_args` for a packed batch (x [T, H, P], dt [T, H], B/C [T, G, N], the pool
    [slots, H, P, N], one slot per sequence); returns the heads per group."""
    if x.dim() != 3 or x.shape[0] != v.num_tokens:
        raise ValueError(f"x must be [T={v.num_tokens}, H, P], got {tuple(x.shape)}")
    if dt.dim() != 2 or B.dim() != 3 or C.dim() != 3:
        raise ValueError(f"dt must be [T, H] and B, C [T, G, N], got {tuple(dt.shape)}, {tuple(B.shape)}")
    check_scan_args(x[None], dt[None], A, B[None], C[None], chunk_size, D, dt_bias, None)
    row = (x.shape[1], x.shape[2], B.shape[2])
    if ssm_pool.dim() != 4 or tuple(ssm_pool.shape[1:]) != row:
        raise ValueError(f"ssm_pool must be [slots, {', '.join(map(str, row))}], got {tuple(ssm_pool.shape)}")
    if state_slots.dim() != 1 or state_slots.shape[0] != v.num_seqs:
        raise ValueError(f"state_slots must be [{v.num_seqs}], got {tuple(state_slots.shape)}")
    return x.shape[1] // B.shape[1]


def max_chunk_length(chunk_size: int, device: torch.device) -> int:
    """The longest chunk `ssd_scan` runs: `chunk_size`, on CPU at most _CPU_CHUNK (faster there: the
    Q x Q decay work grows with Q)."""
    return min(chunk_size, _CPU_CHUNK) if device.type == "cpu" else chunk_size


def chunk_length(length: int, chunk_size: int, device: torch.device) -> int:
    """The length of `ssd_scan`'s equal chunks for a segment of `length` tokens (> 0): at most
    `max_chunk_length`, as few chunks as that allows, and fewer than one chunk of padding."""
    chunk_size = max_chunk_length(chunk_size, device)
    chunks = -(-length // chunk_size)
    return -(-length // chunks)


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
    `chunk_size` bounds the chunk length (on CPU, further capped at the fastest length there);
    the L tokens are cut into equal chunks. Chunking changes only float rounding, never the result.
    """
    check_scan_args(x, dt, A, B, C, chunk_size, D, dt_bias, initial_state)
    batch, length, heads, head_dim = x.shape
    rep = heads // B.shape[2]
    groups, state_size = B.shape[2], B.shape[3]
    state_shape = (batch, heads, head_dim, state_size)
    state_dtype = torch.float32 if initial_state is None else initial_state.dtype
    if length == 0:
        final = x.new_zeros(state_shape, dtype=state_dtype) if initial_state is None else initial_state.clone()
        return ScanResult(x.new_empty(x.shape), final)

    dt = _process_dt(dt, dt_bias, dt_softplus, dt_limit)  # [b, L, h]
    x32 = x.float()
    # Equal chunks: a long segment pads fewer than `chunks` tokens instead of up to a whole chunk.
    q = chunk_length(length, chunk_size, x.device)
    chunks = -(-length // q)
    padded = chunks * q
    # b batch, h head (= g group x r head within group), c chunk, l/s positions in a chunk,
    # p head dim, n state. Heads lead so that every product below is a plain batched matmul.
    # Padded tokens get dt = 0, i.e. no decay and no input: the final state is the last real token's.
    xdt = x32.new_empty(batch, heads, padded, head_dim)
    torch.mul(x32.transpose(1, 2), dt.transpose(1, 2).unsqueeze(-1), out=xdt[:, :, :length])
    dA = x32.new_empty(batch, heads, padded)
    torch.mul(dt.transpose(1, 2), A.float()[:, None], out=dA[:, :, :length])
    Bf = B.float().reshape(batch, length, groups, state_size)
    Cf = C.float().reshape(batch, length, groups, state_size)
    if padded != length:
        xdt[:, :, length:].zero_()
        dA[:, :, length:].zero_()
        Bf = F.pad(Bf, (0, 0, 0, 0, 0, padded - length))
        Cf = F.pad(Cf, (0, 0, 0, 0, 0, padded - length))
    dA = dA.view(batch, heads, chunks, q)
    Bg = Bf.view(batch, chunks, q, groups, state_size).permute(0, 3, 1, 2, 4)  # [b, g, c, s, n]
    Cg = Cf.view(batch, chunks, q, groups, state_size).permute(0, 3, 1, 2, 4)  # [b, g, c, l, n]

    decay_t = _decay_to_later(dA)  # [b, h, c, s, l], unmasked
    decay_from_start = _exp(dA.cumsum(-1))  # [b, h, c, l]: exp(sum_{k<=l} dA_k)
    decay_to_end = decay_t[..., -1].clone()  # [b, h, c, s]: exp(sum_{k>s} dA_k)
    # Contiguous once: as permuted views every product below would copy them again.
    Bg = Bg.contiguous()
    Cg = Cg.contiguous()

    # 1. Within-chunk outputs: the recurrence unrolled as a causal, decay-weighted C·B product.
    # The causal mask goes on the group's C·B, rep times smaller than the heads' decays.
    cb_t = torch.matmul(Bg, Cg.transpose(-1, -2)).triu_()  # [b, g, c, s, l]
    scores_t = decay_t.view(batch, groups, rep, chunks, q, q).mul_(cb_t.unsqueeze(2))
    xh = xdt.view(batch, heads, chunks, q, head_dim)
    y = torch.matmul(scores_t.view(batch, heads, chunks, q, q).transpose(-1, -2), xh)  # [b, h, c, l, p]

    # 2. Each chunk's contribution to the state at its end, starting from zero; the heads of a
    # group share B, so they ride along in one matmul per group: [b, g, c, n, (r p)].
    weighted = x32.new_empty(batch, groups, chunks, q, rep, head_dim)
    torch.mul(
        xh.view(batch, groups, rep, chunks, q, head_dim).permute(0, 1, 3, 4, 2, 5),
        decay_to_end.view(batch, groups, rep, chunks, q, 1).permute(0, 1, 3, 4, 2, 5),
        out=weighted,
    )
    local_states = torch.matmul(Bg.transpose(-1, -2), weighted.view(batch, groups, chunks, q, rep * head_dim))
    local_states = local_states.view(batch, groups, chunks, state_size, rep, head_dim)

    # 3. Carry the boundary states across chunks (the only sequential part): entering[:, :, c] is
    # the state entering chunk c. The final state is kept apart so that `entering` stays one
    # block the product in step 4 reads without a copy.
    entering = x32.new_empty(batch, groups, chunks, state_size, rep, head_dim)
    if initial_state is None:
        entering[:, :, 0].zero_()
    else:
        entering[:, :, 0] = initial_state.reshape(batch, groups, rep, head_dim, state_size).permute(0, 1, 4, 2, 3)
    chunk_decay = decay_from_start[..., -1].view(batch, groups, rep, chunks).permute(0, 1, 3, 2)  # [b, g, c, r]
    for c in range(chunks - 1):
        torch.addcmul(
            local_states[:, :, c], entering[:, :, c], chunk_decay[:, :, c, None, :, None], out=entering[:, :, c + 1]
        )
    last = chunks - 1
    final = torch.addcmul(local_states[:, :, last], entering[:, :, last], chunk_decay[:, :, last, None, :, None])

    # 4. What the state entering each chunk contributes to the chunk's outputs, added while the
    # outputs are written token-major ([b, c, l, g, r, p] is [b, L, h, p]): the transpose the
    # result needs rides on this pass instead of one of its own.
    from_state = torch.matmul(Cg, entering.view(batch, groups, chunks, state_size, rep * head_dim))
    tokens = x32.new_empty(batch, chunks, q, groups, rep, head_dim)
    torch.addcmul(
        y.view(batch, groups, rep, chunks, q, head_dim).permute(0, 3, 4, 1, 2, 5),
        from_state.view(batch, groups, chunks, q, rep, head_dim).permute(0, 2, 3, 1, 4, 5),
        decay_from_start.view(batch, groups, rep, chunks, q, 1).permute(0, 3, 4, 1, 2, 5),
        out=tokens,
    )
    out = tokens.view(batch, padded, heads, head_dim)[:, :length]
    if D is not None:
        out.addcmul_(x32, D.float()[:, None])
    final_state = final.permute(0, 1, 3, 4, 2).reshape(state_shape).to(state_dtype)
    return ScanResult(out.to(x.dtype), final_state)


def check_state_update_args(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, dt_bias: Tensor | None
) -> int:
    """Raise ValueError unless the arguments of `selective_state_update` fit together (every
    implementation checks them so); return the heads per group."""
    if x.dim() != 3:
        raise ValueError(f"x must be [Bt, H, P], got {tuple(x.shape)}")
    batch, heads, head_dim = x.shape
    if tuple(dt.shape) != (batch, heads):
        raise ValueError(f"dt must be [Bt={batch}, H={heads}], got {tuple(dt.shape)}")
    if B.dim() != 3 or B.shape[0] != batch:
        raise ValueError(f"B must be [Bt={batch}, G, N], got {tuple(B.shape)}")
    rep = _check_heads(x, A, B, C, D, dt_bias)
    state_size = B.shape[2]
    if tuple(state.shape) != (batch, heads, head_dim, state_size):
        raise ValueError(
            f"state must be [Bt={batch}, H={heads}, P={head_dim}, N={state_size}], got {tuple(state.shape)}"
        )
    return rep


def check_dt_limit(dt_limit: tuple[float, float]) -> None:
    """Raise ValueError unless dt_limit is (low, high) with low <= high."""
    low, high = dt_limit
    if not low <= high:
        raise ValueError(f"dt_limit must be (low, high) with low <= high, got {dt_limit}")


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
    state_batch_indices: Tensor | None = None,
) -> Tensor:
    """One decode step: state [Bt, H, P, N], x [Bt, H, P], dt [Bt, H], B/C [Bt, G, N]; returns y [Bt, H, P].

    Mutates `state` in place to the state after this token (computed in float32, stored in the
    state's dtype); y is read from the float32 state, before that rounding, and returned in x's dtype.
    With `state_batch_indices` [Bt] (int32/int64), `state` is the whole pool [slots, H, P, N] and
    batch row b updates its row `state_batch_indices[b]`.
    """
    if state_batch_indices is not None:
        rows = check_state_indices(state, x.shape[0], state_batch_indices)
        check_state_update_args(rows, x, dt, A, B, C, D, dt_bias)
        return update_rows_at(
            state,
            state_batch_indices,
            lambda rows: selective_state_update(rows, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit),
        )
    rep = check_state_update_args(state, x, dt, A, B, C, D, dt_bias)
    batch, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
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
    # y = h . C as a row vector times the transposed state: [1, N] @ [N, R*P] per (b, g). The
    # [R*P, N] @ [N, 1] form is a batched matrix-vector product that CPU BLAS runs 3x slower.
    c_rows = C.float().reshape(batch * groups, 1, state_size)
    y = torch.bmm(c_rows, new.reshape(batch * groups, rep * head_dim, state_size).transpose(1, 2))
    y = y.view(batch, heads, head_dim)
    if D is not None:
        y = torch.addcmul(y, x32, D.float()[:, None])
    return y.to(x.dtype)
