"""Twins of `reference.moe`: routing (one program per token) and the routed experts as grouped GEMMs.

The experts run as two grouped GEMMs over the (token, choice) pairs sorted by expert, each
expert's rows padded to whole BLOCK_M blocks (vLLM's "moe_align_block_size"), so every block
belongs to one expert: gate_up + activation (+ gate * up) into an intermediate buffer, then down
times the routing weight. The alignment is computed on the device from a static upper bound on
the padded length, so there is no host synchronisation. The k choices of a token are summed in
float32 at the end.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..reference import moe as _ref
from ..reference.moe import Routing
from .jit_math import dot_precision, next_pow2

_ACTIVATIONS = {name: i for i, name in enumerate(_ref.ACTIVATIONS)}  # silu, gelu, gelu_tanh, relu, relu2
CHECK_EXPERT_IDS_ENV = "HIMAMBA_CHECK_EXPERT_IDS"


@functools.cache
def check_expert_ids() -> bool:
    """Whether `moe_experts` range-checks expert ids (a debug flag: the check syncs with the host)."""
    return os.environ.get(CHECK_EXPERT_IDS_ENV, "") == "1"


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, experts_ptr,
    num_experts, per_group, scaling, sl_t, sl_e,
    TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    es = tl.arange(0, BLOCK_E)
    e_mask = es < num_experts
    logits = tl.load(logits_ptr + t * sl_t + es * sl_e, mask=e_mask, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        p = tl.exp(logits - tl.max(logits, axis=0))
        scores = p / tl.sum(p, axis=0)
    else:
        scores = tl.where(e_mask, 1.0 / (1.0 + tl.exp(-logits)), 0.0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + es, mask=e_mask, other=0.0).to(tl.float32)
    choice = tl.where(e_mask, choice, float("-inf"))
    if N_GROUP > 1:
        # A group ranks by the sum of its two best experts (its only one, if it has one).
        group = es // per_group
        gs = tl.arange(0, BLOCK_G)
        group_scores = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        for gi in tl.static_range(N_GROUP):
            in_group = group == gi
            members = tl.where(in_group, choice, float("-inf"))
            best = tl.max(members, axis=0)
            first = tl.min(tl.where(in_group & (members == best), es, BLOCK_E), axis=0)
            second = tl.max(tl.where(es == first, float("-inf"), members), axis=0)
            two = tl.where(per_group > 1, best + second, best)
            group_scores = tl.where(gs == gi, two, group_scores)
        keep = tl.zeros((BLOCK_E,), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.argmax(group_scores, axis=0)
            keep = keep | (group == top)
            group_scores = tl.where(gs == top, float("-inf"), group_scores)
        choice = tl.where(keep, choice, float("-inf"))
    ks = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    experts = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        weights = tl.where(ks == j, tl.sum(tl.where(es == best, scores, 0.0), axis=0), weights)
        experts = tl.where(ks == j, best.to(tl.int64), experts)
        choice = tl.where(es == best, float("-inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scaling
    tl.store(weights_ptr + t * TOP_K + ks, weights, mask=ks < TOP_K)
    tl.store(experts_ptr + t * TOP_K + ks, experts, mask=ks < TOP_K)


@triton.jit
def _activate(h, ACT: tl.constexpr):
    if ACT == 0:
        h = h / (1.0 + tl.exp(-h))
    elif ACT == 1:
        h = 0.5 * h * (1.0 + tl.erf(h * 0.7071067811865476))
    elif ACT == 2:
        inner = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        h = 0.5 * h * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0))
    elif ACT == 3:
        h = tl.maximum(h, 0.0)
    else:
        h = tl.maximum(h, 0.0)
        h = h * h
    return h


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, pair_ptr, block_expert_ptr, inter_ptr,
    top_k, num_pairs, hidden, inter, sx_t, sw_e, sw_r, sw_h, s_inter,
    GATED: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """inter[row] = act(x[token] @ gate_e^T) * (x[token] @ up_e^T) for the rows of one expert's block."""
    block = tl.program_id(0)
    # An expert's run starts at a block boundary, so a block whose first row is padding is all
    # padding (the static bound leaves up to E * (BLOCK_M - 1) such rows): skip it.
    if tl.load(pair_ptr + block * BLOCK_M) >= num_pairs:
        return
    expert = tl.load(block_expert_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ptr + rows)
    row_mask = pairs < num_pairs
    tokens = tl.where(row_mask, pairs // top_k, 0)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < inter
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + expert * sw_e
    for h0 in range(0, hidden, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        h_mask = hs < hidden
        x = tl.load(x_ptr + tokens[:, None] * sx_t + hs[None, :], mask=row_mask[:, None] & h_mask[None, :], other=0.0)
        x = x.to(tl.float32)
        w_mask = n_mask[None, :] & h_mask[:, None]
        if GATED:
            # Gate rows first, then up rows, as transformers stores gate_up.
            w_gate = tl.load(w_base + ns[None, :] * sw_r + hs[:, None] * sw_h, mask=w_mask, other=0.0)
            acc_gate += tl.dot(x, w_gate.to(tl.float32), input_precision=PRECISION)
            w_up = tl.load(w_base + (inter + ns)[None, :] * sw_r + hs[:, None] * sw_h, mask=w_mask, other=0.0)
        else:
            w_up = tl.load(w_base + ns[None, :] * sw_r + hs[:, None] * sw_h, mask=w_mask, other=0.0)
        acc_up += tl.dot(x, w_up.to(tl.float32), input_precision=PRECISION)
    out_ty = inter_ptr.dtype.element_ty
    if GATED:
        # As the reference, which runs each expert in x's dtype: round each product before combining.
        h = _activate(acc_gate.to(out_ty).to(tl.float32), ACT).to(out_ty).to(tl.float32) * acc_up.to(out_ty).to(
            tl.float32
        )
    else:
        h = _activate(acc_up.to(out_ty).to(tl.float32), ACT)
    tl.store(inter_ptr + rows[:, None] * s_inter + ns[None, :], h.to(out_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    inter_ptr, w_ptr, pair_ptr, block_expert_ptr, weights_ptr, out_ptr,
    num_pairs, hidden, inter, s_inter, sw_e, sw_h, sw_i, s_out,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    """out[pair] = routing weight * (inter[row] @ down_e^T), in float32, for one expert's block."""
    block = tl.program_id(0)
    if tl.load(pair_ptr + block * BLOCK_M) >= num_pairs:  # an all-padding block, as in _gate_up_kernel
        return
    expert = tl.load(block_expert_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ptr + rows)
    row_mask = pairs < num_pairs
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i0 in range(0, inter, BLOCK_I):
        i_s = i0 + tl.arange(0, BLOCK_I)
        i_mask = i_s < inter
        h = tl.load(inter_ptr + rows[:, None] * s_inter + i_s[None, :], mask=row_mask[:, None] & i_mask[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(w_ptr + expert * sw_e + ns[None, :] * sw_h + i_s[:, None] * sw_i,
                    mask=n_mask[None, :] & i_mask[:, None], other=0.0).to(tl.float32)  # fmt: skip
        acc += tl.dot(h, w, input_precision=PRECISION)
    acc = acc.to(inter_ptr.dtype.element_ty).to(tl.float32)  # the expert's output, in x's dtype
    weight = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)
    tl.store(out_ptr + pairs[:, None] * s_out + ns[None, :], acc * weight[:, None],
             mask=row_mask[:, None] & n_mask[None, :])  # fmt: skip


def moe_route(
    router_logits: Tensor,
    top_k: int,
    scoring: str,
    norm_topk_prob: bool,
    bias: Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    n_group: int = 1,
    topk_group: int = 1,
) -> Routing:
    """Twin of `reference.moe.moe_route`."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    tokens, num_experts = router_logits.shape
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if n_group < 1 or num_experts % n_group != 0:
        raise ValueError(f"n_group ({n_group}) must divide the number of experts ({num_experts})")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    per_group = num_experts // n_group
    if not 1 <= top_k <= topk_group * per_group:
        raise ValueError(f"top_k must be in [1, {topk_group * per_group}] (eligible experts), got {top_k}")
    if bias is not None and tuple(bias.shape) != (num_experts,):
        raise ValueError(f"bias must be [E={num_experts}], got {tuple(bias.shape)}")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    experts = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens == 0:
        return Routing(weights, experts)
    _route_kernel[(tokens,)](
        router_logits, router_logits if bias is None else bias, weights, experts,
        num_experts, per_group, float(routed_scaling_factor), *router_logits.stride(),
        TOP_K=top_k, SOFTMAX=scoring == "softmax", NORM=norm_topk_prob, HAS_BIAS=bias is not None,
        N_GROUP=n_group, TOPK_GROUP=topk_group, BLOCK_E=next_pow2(num_experts), BLOCK_K=next_pow2(top_k),
        BLOCK_G=next_pow2(n_group),
    )  # fmt: skip
    return Routing(weights, experts)


def _align(experts: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """Pairs sorted by expert, each expert's run padded to whole blocks (pad entries: num_pairs).

    Returns (pair index per padded row [R], expert per block [R // block_m]); R is a static bound,
    so the shapes never depend on device values. Blocks past the last expert's are all padding.
    """
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    order = flat.argsort(stable=True)
    # Not bincount: on CUDA it reads the largest id back to size its output (a host sync).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # padded end row of each expert
    # The i-th pair in expert order goes to row i + (its expert's padded start - its unpadded start).
    shift = (ends - padded) - (torch.cumsum(counts, 0) - counts)
    rows = torch.arange(num_pairs, device=flat.device) + shift[flat[order]]
    bound = (num_pairs + num_experts * (block_m - 1) + block_m - 1) // block_m * block_m
    pair_of_row = torch.full((bound,), num_pairs, dtype=torch.int64, device=flat.device)
    pair_of_row[rows] = order
    block_starts = torch.arange(0, bound, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return pair_of_row, block_expert


def moe_experts(
    x: Tensor,
    routing: Routing,
    gate_up_weights: Tensor,
    down_weights: Tensor,
    activation: str,
    gated: bool = True,
) -> Tensor:
    """Twin of `reference.moe.moe_experts`. Expert ids are range-checked (two host syncs) only under
    HIMAMBA_CHECK_EXPERT_IDS=1: on the serving path they come from `moe_route`, in range by
    construction."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ref.ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    tokens, hidden = x.shape
    if down_weights.dim() != 3 or down_weights.shape[1] != hidden:
        raise ValueError(f"down_weights must be [E, H={hidden}, I], got {tuple(down_weights.shape)}")
    num_experts, _, inter = down_weights.shape
    up_rows = 2 * inter if gated else inter
    if tuple(gate_up_weights.shape) != (num_experts, up_rows, hidden):
        raise ValueError(
            f"gate_up_weights must be [E={num_experts}, {up_rows}, H={hidden}] (gated={gated}), "
            f"got {tuple(gate_up_weights.shape)}"
        )
    weights, experts = routing
    if experts.dim() != 2 or experts.shape[0] != tokens or weights.shape != experts.shape:
        raise ValueError(
            f"routing must hold weights and experts [T={tokens}, k], "
            f"got {tuple(weights.shape)} and {tuple(experts.shape)}"
        )
    if experts.dtype != torch.int64:
        raise ValueError(f"routing.experts must be int64, got {experts.dtype}")
    if check_expert_ids() and experts.numel():
        lo, hi = int(experts.min()), int(experts.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"routing.experts must be in [0, E={num_experts}), got min {lo} max {hi}")
    top_k = experts.shape[1]
    if tokens == 0 or top_k == 0:
        return torch.zeros(tokens, hidden, dtype=x.dtype, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    block_m = 16
    pair_of_row, block_expert = _align(experts, num_experts, block_m)
    rows = pair_of_row.shape[0]
    inter_buf = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    precision = dot_precision(x, gate_up_weights)
    block_n = min(64, next_pow2(inter, 16))
    _gate_up_kernel[(rows // block_m, triton.cdiv(inter, block_n))](
        x, gate_up_weights, pair_of_row, block_expert, inter_buf,
        top_k, tokens * top_k, hidden, inter, x.stride(0), *gate_up_weights.stride(), inter_buf.stride(0),
        GATED=gated, ACT=_ACTIVATIONS[activation], PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_H=min(64, next_pow2(hidden, 16)),
    )  # fmt: skip
    per_pair = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    pair_weights = weights.reshape(-1).float()
    block_h = min(64, next_pow2(hidden, 16))
    _down_kernel[(rows // block_m, triton.cdiv(hidden, block_h))](
        inter_buf, down_weights, pair_of_row, block_expert, pair_weights, per_pair,
        tokens * top_k, hidden, inter, inter_buf.stride(0), *down_weights.stride(), per_pair.stride(0),
        PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_h, BLOCK_I=min(64, next_pow2(inter, 16)),
    )  # fmt: skip
    return per_pair.view(tokens, top_k, hidden).sum(1).to(x.dtype)
