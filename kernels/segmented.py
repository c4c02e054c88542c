"""The varlen prefill ops run segment by segment: what CPU tensors run where no native varlen kernel
takes them (the PyTorch references: tensors other than float32, HIMAMBA_KERNELS=reference), and the
reference the native and Triton varlen kernels are checked against.

Each sequence is cut at its capture offsets; a per-segment op (`causal_conv1d`, `ssd_scan`, ...; the
native kernel or the PyTorch reference, as `dispatch` picks) runs each piece from the state the
previous one left (or from the sequence's slot when it has a cached prefix, or zeros), the state after
a piece is copied into the capture slots at its end, and the final one into the sequence's slot.
A call per segment costs a Python round and a concatenation of the pieces on CPU, a launch each on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .reference import attention as _attention_ref
from .reference import conv1d as _conv_ref
from .reference import selective_scan as _selective_scan_ref
from .reference import ssd as _ssd_ref
from .reference.state_rows import gather_state_rows, scatter_state_rows
from .varlen import Varlen

# One sequence's state by component name, each [1, *row].
State = dict[str, Tensor]
# step(start, end, state or None for zeros) -> (outputs of tokens [start, end), state after `end`)
Step = Callable[[int, int, State | None], tuple[Tensor, State]]


class Segment(NamedTuple):
    """Tokens [start, end) of the packed token axis, all of sequence `seq`."""

    seq: int
    start: int
    end: int
    first: bool  # starts the sequence: its initial state is its slot's (prefix_len > 0) or zeros
    last: bool  # ends the sequence: its final state goes back to the sequence's slot
    capture_slots: tuple[int, ...]  # state slots that receive a copy of the state after `end`


def segments(v: Varlen) -> list[Segment]:
    """The segments of a packed batch, in token order."""
    out: list[Segment] = []
    start = 0
    for i, new_len in enumerate(v.new_lens):
        captures = v.captures[i] if v.captures else ()
        cuts = sorted({o for o, _ in captures} | {new_len})
        seg_start = 0
        for cut in cuts:
            slots = tuple(s for o, s in captures if o == cut)
            out.append(Segment(i, start + seg_start, start + cut, seg_start == 0, cut == new_len, slots))
            seg_start = cut
        start += new_len
    return out


def run_segments(v: Varlen, state_slots: Tensor, pool: dict[str, Tensor], step: Step) -> Tensor:
    """Run `step` over every segment of the batch; returns the concatenated outputs [T, ...].

    Reads a sequence's initial state from its slot only when it has a prefix (so a fresh sequence
    never sees what its slot held); writes captures and final states into `pool`."""
    outs: list[Tensor] = []
    state: State | None = None
    for seg in segments(v):
        if seg.first:
            slot = state_slots[seg.seq : seg.seq + 1]
            state = {n: gather_state_rows(t, slot) for n, t in pool.items()} if v.prefix_lens[seg.seq] > 0 else None
        out, state = step(seg.start, seg.end, state)
        outs.append(out)
        if seg.capture_slots:
            targets = torch.tensor(seg.capture_slots, dtype=torch.int64, device=state_slots.device)
            for name, t in pool.items():
                s = state[name]
                scatter_state_rows(t, targets, s.expand(len(seg.capture_slots), *s.shape[1:]))
        if seg.last:
            for name, t in pool.items():
                scatter_state_rows(t, state_slots[seg.seq : seg.seq + 1], state[name])
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def conv1d_varlen(
    conv: Callable[..., Any],
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
    activation: str | None,
) -> Tensor:
    """`causal_conv1d_varlen` by segments of `conv` (a `causal_conv1d`)."""
    _conv_ref.check_varlen_args(x, weight, bias, conv_pool, state_slots, v, activation)

    def step(start: int, end: int, carried: State | None) -> tuple[Tensor, State]:
        res = conv(
            x[start:end].t().unsqueeze(0), weight, bias, None if carried is None else carried["conv"], activation
        )
        return res.out[0].t(), {"conv": res.final_state}

    return run_segments(v, state_slots, {"conv": conv_pool}, step)


def ssd_scan_varlen(
    scan: Callable[..., Any],
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    ssm_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
) -> Tensor:
    """`ssd_scan_varlen` by segments of `scan` (an `ssd_scan`)."""
    _ssd_ref.check_varlen_scan_args(x, dt, A, B, C, chunk_size, D, dt_bias, ssm_pool, state_slots, v)

    def step(start: int, end: int, carried: State | None) -> tuple[Tensor, State]:
        res = scan(
            x[None, start:end], dt[None, start:end], A, B[None, start:end], C[None, start:end], chunk_size,
            D, dt_bias, dt_softplus, dt_limit, None if carried is None else carried["ssm"],
        )  # fmt: skip
        return res.y[0], {"ssm": res.final_state}

    return run_segments(v, state_slots, {"ssm": ssm_pool}, step)


def selective_scan_varlen(
    scan: Callable[..., Any],
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    delta_softplus: bool,
    ssm_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
) -> Tensor:
    """`selective_scan_varlen` by segments of `scan` (a Mamba1 `selective_scan`)."""
    _selective_scan_ref.check_varlen_args(u, delta, A, B, C, D, z, delta_bias, ssm_pool, state_slots, v)

    def step(start: int, end: int, carried: State | None) -> tuple[Tensor, State]:
        res = scan(
            u[None, start:end], delta[None, start:end], A, B[None, start:end], C[None, start:end], D,
            None if z is None else z[None, start:end], delta_bias, delta_softplus,
            None if carried is None else carried["ssm"],
        )  # fmt: skip
        return res.y[0], {"ssm": res.final_state}

    return run_segments(v, state_slots, {"ssm": ssm_pool}, step)


def gated_delta_rule_varlen(
    rule: Callable[..., Any],
    q: Tensor,
    k: Tensor,
    val: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int,
    state_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
    use_qk_l2norm: bool,
    scale: float | None,
) -> Tensor:
    """`chunk_gated_delta_rule_varlen` by segments of `rule` (a `chunk_gated_delta_rule`)."""
    _check_packed(q, state_slots, v)

    def step(start: int, end: int, carried: State | None) -> tuple[Tensor, State]:
        res = rule(
            q[None, start:end], k[None, start:end], val[None, start:end], g[None, start:end],
            beta[None, start:end], chunk_size, None if carried is None else carried["recurrent"],
            use_qk_l2norm, scale,
        )  # fmt: skip
        return res.out[0], {"recurrent": res.final_state}

    return run_segments(v, state_slots, {"recurrent": state_pool}, step)


def attention_prefill_varlen(
    attend: Callable[..., Any],
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_table: Tensor,
    v: Varlen,
    scale: float,
) -> Tensor:
    """`paged_attention_prefill_varlen` one sequence at a time with `attend` (a `paged_attention_prefill`)."""
    _attention_ref.check_prefill_varlen_args(q, k_cache, v_cache, slot_table, v)
    outs, start = [], 0
    for i, (prefix, n) in enumerate(zip(v.prefix_lens, v.new_lens, strict=True)):
        outs.append(attend(q[start : start + n], k_cache, v_cache, slot_table[i, : prefix + n], prefix, scale))
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _check_packed(x: Tensor, state_slots: Tensor, v: Varlen) -> None:
    if x.shape[0] != v.num_tokens:
        raise ValueError(f"expected {v.num_tokens} packed tokens, got {tuple(x.shape)}")
    if state_slots.dim() != 1 or state_slots.shape[0] != v.num_seqs:
        raise ValueError(f"state_slots must be [{v.num_seqs}], got {tuple(state_slots.shape)}")
