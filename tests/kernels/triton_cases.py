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
DEVICE = torch.device("cpu")


def case(**grid: list[Any]) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Register `fn` once per combination of the given parameter values."""

    def register(fn: Callable[..., int]) -> Callable[..., int]:
        names = list(grid)
        for values in itertools.product(*grid.values()):
            params = dict(zip(names, values))
            label = ",".join(
                f"{k}={getattr(v, 'name', None) or str(v).replace('torch.', '')}" for k, v in params.items()
            )
            CASES.append(Case(f"{fn.__name__}[{label}]", fn, params))
        return fn

    return register


def twin(module: str) -> Any:
    return importlib.import_module(f"himamba.kernels.triton.{module}")


def ref(module: str) -> Any:
    return importlib.import_module(f"himamba.kernels.reference.{module}")


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=DEVICE, dtype=dtype)


def idx(values: list[int]) -> torch.Tensor:
    """An int64 index tensor on the cases' device."""
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def use_device(device: str) -> None:
    """Run the cases' tensors on `device` (CPU under the interpreter; "cuda" in the GPU-only module)."""
    global DEVICE
    DEVICE = torch.device(device)


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


# Decode updates run on pool rows in place (consecutive slots), on a gathered copy, or on the whole
# pool with the batch's slots as state_batch_indices (shuffled, not consecutive, int64 or int32).
UPDATE_ROWS = ["pool", "gathered", "indexed-i64", "indexed-i32"]


def state_rows(pool: torch.Tensor, rows: str, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a decode update gets as its state for `rows` (see UPDATE_ROWS), and its slot indices (or None)."""
    if rows == "pool":
        return pool.narrow(0, 2, len(slots)), None
    if rows == "gathered":
        return pool.index_select(0, idx(slots)), None
    return pool, idx(slots).to(torch.int32 if rows == "indexed-i32" else torch.int64)


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


@case(bias=[True, False], rows=UPDATE_ROWS, dtype=[torch.float32, torch.float16])
def causal_conv1d_update(bias: bool, rows: str, dtype: torch.dtype) -> int:
    batch, channels, width = 3, 72, 4
    x = columns(rand(batch, channels, seed=1, dtype=dtype), 33, seed=2)  # the xBC split of a projection
    pool = rand(8, channels, width - 1, seed=3, dtype=dtype)
    weight, b = rand(channels, width, seed=4, dtype=dtype), rand(channels, seed=5, dtype=dtype) if bias else None
    state, slots = state_rows(pool, rows, [5, 0, 7])
    want_state = state.clone()
    want = ref("conv1d").causal_conv1d_update(x, want_state, weight, b, "silu", slots)
    got = twin("conv1d").causal_conv1d_update(x, state, weight, b, "silu", slots)
    return check(got, want, dtype) + check(state, want_state, dtype)


# -------------------------------------------------------------------------------------------- ssd


def _ssd_inputs(batch: int, length: int, heads: int, head_dim: int, groups: int, dtype=torch.float32) -> dict:
    state_size = 16
    return {
        "x": rand(batch, length, heads, head_dim, seed=1, dtype=dtype),
        "dt": rand(batch, length, heads, seed=2, dtype=dtype),
        "A": -torch.exp(rand(heads, seed=3)),
        "B": rand(batch, length, groups, state_size, seed=4, dtype=dtype),
        "C": rand(batch, length, groups, state_size, seed=5, dtype=dtype),
        "D": rand(heads, seed=6),
        "dt_bias": rand(heads, seed=7),
        "initial_state": rand(batch, heads, head_dim, state_size, seed=8),
    }


@case(length=[1, 16, 37, 70], groups=[1, 2], init=[True, False])
def ssd_scan(length: int, groups: int, init: bool) -> int:
    args = _ssd_inputs(2, length, 4, 16, groups)
    if not init:
        args["initial_state"] = None
    want = ref("ssd").ssd_scan(chunk_size=16, **args)
    got = twin("ssd").ssd_scan(chunk_size=16, **args)
    assert type(got) is type(want)
    return check(got.y, want.y, scale=5) + check(got.final_state, want.final_state, scale=5)


@case(head_dim=[64, 128], options=["plain", "limit", "no-softplus"], dtype=[torch.float32, torch.float16])
def ssd_scan_options(head_dim: int, options: str, dtype: torch.dtype) -> int:
    args = _ssd_inputs(1, 40, 2, head_dim, 1, dtype)
    kw = {"dt_limit": (0.05, 2.0)} if options == "limit" else {}
    if options == "no-softplus":
        kw = {"dt_softplus": False, "D": None}
        args["dt"] = args["dt"].abs()
    args |= kw
    want = ref("ssd").ssd_scan(chunk_size=256, **args)
    got = twin("ssd").ssd_scan(chunk_size=256, **args)
    return check(got.y, want.y, dtype, scale=5) + check(got.final_state, want.final_state, scale=50)


@case(offset=[0, 16, 36], layout=["segment-views"])
def ssd_scan_capture_offsets(offset: int, layout: str) -> int:
    """Capture offsets as the worker takes them (at 0, a chunk boundary, the last token): the prefill
    is cut into segments there, each continuing from the last's final state; the state at the cut is
    the reference's over the first part and the outputs equal one pass over the whole."""
    length = 37
    args = _ssd_inputs(1, length, 4, 16, 2)
    whole = ref("ssd").ssd_scan(chunk_size=16, **args)
    head = {k: (v[:, :offset] if k in ("x", "dt", "B", "C") else v) for k, v in args.items()}
    tail = {k: (v[:, offset:] if k in ("x", "dt", "B", "C") else v) for k, v in args.items()}
    first = twin("ssd").ssd_scan(chunk_size=16, **head)
    second = twin("ssd").ssd_scan(chunk_size=16, **(tail | {"initial_state": first.final_state}))
    want_mid = ref("ssd").ssd_scan(chunk_size=16, **head).final_state
    return (
        check(first.final_state, want_mid, scale=5)
        + check(torch.cat([first.y, second.y], dim=1), whole.y, scale=5)
        + check(second.final_state, whole.final_state, scale=5)
    )


@case(groups=[1, 2], rows=UPDATE_ROWS, limit=[False, True])
def selective_state_update(groups: int, rows: str, limit: bool) -> int:
    batch, heads, head_dim, state_size = 3, 4, 16, 16
    pool = rand(8, heads, head_dim, state_size, seed=1)
    state, slots = state_rows(pool, rows, [6, 1, 4])
    # x, B and C as the Mamba2 layer passes them: reshaped column splits of one projection.
    xbc = rand(batch, heads * head_dim + 2 * groups * state_size + 5, seed=2)
    x = xbc[:, : heads * head_dim].reshape(batch, heads, head_dim)
    b = xbc[:, heads * head_dim : heads * head_dim + groups * state_size].reshape(batch, groups, state_size)
    c = xbc[:, heads * head_dim + groups * state_size : -5].reshape(batch, groups, state_size)
    dt = columns(rand(batch, heads, seed=3), 3, seed=4)
    A, D, bias = -torch.exp(rand(heads, seed=5)), rand(heads, seed=6), rand(heads, seed=7)
    kw: dict = {"dt_limit": (0.1, 1.0)} if limit else {}
    kw["state_batch_indices"] = slots
    want_state = state.clone()
    want = ref("ssd").selective_state_update(want_state, x, dt, A, b, c, D, bias, **kw)
    got = twin("ssd").selective_state_update(state, x, dt, A, b, c, D, bias, **kw)
    return check(got, want) + check(state, want_state)


# -------------------------------------------------------------------------------------- attention

POOL_SLOTS = 400


def _pool(kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return rand(POOL_SLOTS, kv_heads, head_dim, seed=11, dtype=dtype), rand(
        POOL_SLOTS, kv_heads, head_dim, seed=12, dtype=dtype
    )


def _slots(count: int, seed: int) -> torch.Tensor:
    """Scattered token slots, as pages of a fragmented pool give them."""
    return torch.randperm(POOL_SLOTS, generator=torch.Generator().manual_seed(seed))[:count].to(DEVICE)


@case(prefix=[0, 31, 64], new=[1, 33], gqa=["8:2", "4:4"], head_dim=[64, 128])
def paged_attention_prefill(prefix: int, new: int, gqa: str, head_dim: int) -> int:
    q_heads, kv_heads = map(int, gqa.split(":"))
    dtype = torch.float32
    k_cache, v_cache = _pool(kv_heads, head_dim, dtype)
    slots = _slots(prefix + new, seed=prefix * 7 + new)
    q = rand(new, q_heads, head_dim, seed=13, dtype=dtype)
    want = ref("attention").paged_attention_prefill(q, k_cache, v_cache, slots, prefix, head_dim**-0.5)
    got = twin("attention").paged_attention_prefill(q, k_cache, v_cache, slots, prefix, head_dim**-0.5)
    return check(got, want, scale=5)


@case(gqa=["8:2", "4:4", "6:1"], head_dim=[64, 128], dtype=[torch.float32, torch.float16])
def paged_attention_decode(gqa: str, head_dim: int, dtype: torch.dtype) -> int:
    q_heads, kv_heads = map(int, gqa.split(":"))
    k_cache, v_cache = _pool(kv_heads, head_dim, dtype)
    # Ragged lengths around the kernel's 32-key blocks (and 16-token pages): 1, 16, 32, 33, 70.
    lens = idx([1, 16, 32, 33, 70])
    table = _slots(5 * 70, seed=3).view(5, 70)
    q = rand(5, q_heads, head_dim, seed=4, dtype=dtype)
    want = ref("attention").paged_attention_decode(q, k_cache, v_cache, table, lens, head_dim**-0.5)
    got = twin("attention").paged_attention_decode(q, k_cache, v_cache, table, lens, head_dim**-0.5)
    return check(got, want, dtype, scale=5)


@case(dtype=[torch.float32, torch.float16], kv_layout=["split-view", "contiguous"])
def write_kv(dtype: torch.dtype, kv_layout: str) -> int:
    k_cache, v_cache = _pool(2, 64, dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = _slots(9, seed=5)
    kv = rand(9, 2 * 2 * 64 + 8, seed=6)  # a fused k|v projection, in float32 (cast on write)
    k, v = kv[:, :128].view(9, 2, 64), kv[:, 128:256].view(9, 2, 64)
    if kv_layout == "contiguous":
        k, v = k.contiguous(), v.contiguous()
    ref("attention").write_kv(want_k, want_v, slots, k, v)
    twin("attention").write_kv(k_cache, v_cache, slots, k, v)
    return check(k_cache, want_k, dtype) + check(v_cache, want_v, dtype)


# --------------------------------------------------------------------------------- mamba1 scan


def _mamba1_inputs(batch: int, length: int, channels: int, dtype=torch.float32) -> dict:
    state_size = 16
    # u and z as Mamba1's in_proj(x).chunk(2) gives them: strided halves of one projection.
    uz = rand(batch, length, 2 * channels, seed=1, dtype=dtype)
    return {
        "u": uz[..., :channels],
        "delta": rand(batch, length, channels, seed=2, dtype=dtype),
        "A": -torch.exp(rand(channels, state_size, seed=3)),
        "B": rand(batch, length, state_size, seed=4, dtype=dtype),
        "C": rand(batch, length, state_size, seed=5, dtype=dtype),
        "D": rand(channels, seed=6),
        "z": uz[..., channels:],
        "delta_bias": rand(channels, seed=7),
        "initial_state": rand(batch, channels, state_size, seed=8),
    }


@case(length=[1, 9, 70], channels=[24], options=["all", "bare"])
def selective_scan(length: int, channels: int, options: str) -> int:
    return _mamba1_scan(length, channels, options)


@case(length=[33], channels=[160], options=["all"])  # several channel blocks
def selective_scan_wide(length: int, channels: int, options: str) -> int:
    return _mamba1_scan(length, channels, options)


def _mamba1_scan(length: int, channels: int, options: str) -> int:
    args = _mamba1_inputs(2, length, channels)
    if options == "bare":
        args |= {"D": None, "z": None, "delta_bias": None, "initial_state": None, "delta_softplus": False}
        args["delta"] = args["delta"].abs()
    want = ref("selective_scan").selective_scan(**args)
    got = twin("selective_scan").selective_scan(**args)
    assert type(got) is type(want)
    return check(got.y, want.y, scale=5) + check(got.final_state, want.final_state, scale=5)


@case(options=["all", "bare"], dtype=[torch.float32, torch.float16], rows=["batch"])
def selective_state_update_mamba1(options: str, dtype: torch.dtype, rows: str) -> int:
    return _mamba1_update(options, dtype, rows)


@case(options=["all"], dtype=[torch.float32], rows=["indexed-i64", "indexed-i32"])
def selective_state_update_mamba1_indexed(options: str, dtype: torch.dtype, rows: str) -> int:
    return _mamba1_update(options, dtype, rows)


def _mamba1_update(options: str, dtype: torch.dtype, rows: str) -> int:
    args = {
        k: (v[:, 0] if k in ("u", "delta", "B", "C", "z") else v) for k, v in _mamba1_inputs(3, 1, 40, dtype).items()
    }
    state = args.pop("initial_state")
    x, dt, bias = args.pop("u"), args.pop("delta"), args.pop("delta_bias")
    kw: dict = {"D": args["D"], "z": args["z"], "dt_bias": bias}
    if options == "bare":
        kw = {"dt_softplus": False}
        dt = dt.abs()
    if rows != "batch":
        state, kw["state_batch_indices"] = state_rows(rand(7, *state.shape[1:], seed=9), rows, [4, 0, 6])
    want_state = state.clone()
    want = ref("selective_scan").selective_state_update_mamba1(want_state, x, dt, args["A"], args["B"], args["C"], **kw)
    got = twin("selective_scan").selective_state_update_mamba1(state, x, dt, args["A"], args["B"], args["C"], **kw)
    return check(got, want, dtype) + check(state, want_state)


# ---------------------------------------------------------------------------------- delta rule


def _delta_inputs(batch: int, length: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, dtype=torch.float32):
    # q, k, v as Qwen3-Next's layer passes them: views into one projection, [.., heads, dim] each.
    width = 2 * k_heads * k_dim + v_heads * v_dim
    qkv = rand(batch, length, width, seed=1, dtype=dtype)
    q = qkv[..., : k_heads * k_dim].unflatten(-1, (k_heads, k_dim))
    k = qkv[..., k_heads * k_dim : 2 * k_heads * k_dim].unflatten(-1, (k_heads, k_dim))
    v = qkv[..., 2 * k_heads * k_dim :].unflatten(-1, (v_heads, v_dim))
    g = -torch.nn.functional.softplus(rand(batch, length, v_heads, seed=2))
    beta = rand(batch, length, v_heads, seed=3).sigmoid()
    init = rand(batch, v_heads, k_dim, v_dim, seed=4) * 0.1
    return q, k, v, g, beta, init


@case(length=[1, 19], heads=["2:4", "2:2"], init=[True, False], l2norm=[True])
def chunk_gated_delta_rule(length: int, heads: str, init: bool, l2norm: bool) -> int:
    return _chunk_delta(length, heads, init, l2norm)


@case(length=[40], heads=["1:2"], init=[True], l2norm=[False])
def chunk_gated_delta_rule_long(length: int, heads: str, init: bool, l2norm: bool) -> int:
    return _chunk_delta(length, heads, init, l2norm)


@case(length=[70], dims=["64:64", "128:128"], decay=["strong"])
def chunk_gated_delta_rule_default_chunk(length: int, dims: str, decay: str) -> int:
    """chunk_size 64 (the default; the twin's chunks are 32): three chunks, strong decays, head dims 64 and 128."""
    k_dim, v_dim = map(int, dims.split(":"))
    return _chunk_delta(length, "1:2", True, True, chunk=64, dims=(k_dim, v_dim), decay_scale=6.0)


def _chunk_delta(
    length: int, heads: str, init: bool, l2norm: bool, chunk: int = 16, dims=(16, 48), decay_scale: float = 1.0
) -> int:
    k_heads, v_heads = map(int, heads.split(":"))
    q, k, v, g, beta, state = _delta_inputs(2, length, k_heads, v_heads, *dims)
    g = g * decay_scale
    kw = {"initial_state": state if init else None, "use_qk_l2norm": l2norm, "scale": None if l2norm else 0.05}
    want = ref("delta_rule").chunk_gated_delta_rule(q, k, v, g, beta, chunk, **kw)
    got = twin("delta_rule").chunk_gated_delta_rule(q, k, v, g, beta, chunk, **kw)
    assert type(got) is type(want)
    return check(got.out, want.out, scale=10) + check(got.final_state, want.final_state, scale=10)


@case(dims=["64:64", "128:128"], rows=["pool", "gathered"], dtype=[torch.float32, torch.float16])
def recurrent_gated_delta_rule_update(dims: str, rows: str, dtype: torch.dtype) -> int:
    return _delta_update(dims, rows, dtype)


@case(dims=["64:64"], rows=["indexed-i64", "indexed-i32"], dtype=[torch.float32])
def recurrent_gated_delta_rule_update_indexed(dims: str, rows: str, dtype: torch.dtype) -> int:
    return _delta_update(dims, rows, dtype)


def _delta_update(dims: str, rows: str, dtype: torch.dtype) -> int:
    k_dim, v_dim = map(int, dims.split(":"))
    q, k, v, g, beta, _ = _delta_inputs(3, 1, 2, 4, k_dim, v_dim, dtype)
    q, k, v, g, beta = (t[:, 0] for t in (q, k, v, g, beta))
    pool = rand(6, 4, k_dim, v_dim, seed=9) * 0.1
    state, slots = state_rows(pool, rows, [4, 0, 2])
    want_state = state.clone()
    want = ref("delta_rule").recurrent_gated_delta_rule_update(q, k, v, g, beta, want_state, state_batch_indices=slots)
    got = twin("delta_rule").recurrent_gated_delta_rule_update(q, k, v, g, beta, state, state_batch_indices=slots)
    return check(got, want, dtype) + check(state, want_state, scale=5)


# ------------------------------------------------------------------------------------------- moe


@case(family=["qwen3-next", "jamba", "nemotron-h"], experts=[16, 64])
def moe_route(family: str, experts: int) -> int:
    return _route(family, experts)


@case(family=["nemotron-h-one-per-group"], experts=[16])  # unrolls a loop per group: kept small
def moe_route_groups(family: str, experts: int) -> int:
    return _route(family, experts)


def _route(family: str, experts: int) -> int:
    logits = rand(23, experts, seed=1)
    bias = rand(experts, seed=2) * 0.1
    kw = {
        "qwen3-next": {"top_k": 4, "scoring": "softmax", "norm_topk_prob": True},
        "jamba": {"top_k": 2, "scoring": "softmax", "norm_topk_prob": False},
        "nemotron-h": {"top_k": 4, "scoring": "sigmoid", "norm_topk_prob": True, "bias": bias,
                       "routed_scaling_factor": 2.5, "n_group": 4, "topk_group": 2},
        "nemotron-h-one-per-group": {"top_k": 3, "scoring": "sigmoid", "norm_topk_prob": True, "bias": bias,
                                     "n_group": experts, "topk_group": 5},
    }[family]  # fmt: skip
    want = ref("moe").moe_route(logits, **kw)
    got = twin("moe").moe_route(logits, **kw)
    assert type(got) is type(want)
    assert torch.equal(got.experts, want.experts), (got.experts, want.experts)
    return check(got.weights, want.weights) + 1


@case(activation=["silu", "gelu", "gelu_pytorch_tanh"], gated=[True], dtype=[torch.float32, torch.float16])
def moe_experts(activation: str, gated: bool, dtype: torch.dtype) -> int:
    return _experts(activation, gated, dtype)


@case(activation=["relu2", "relu"], gated=[False], dtype=[torch.float32])
def moe_experts_plain(activation: str, gated: bool, dtype: torch.dtype) -> int:
    return _experts(activation, gated, dtype)


def _experts(activation: str, gated: bool, dtype: torch.dtype) -> int:
    tokens, hidden, inter, num_experts, top_k = 37, 48, 24, 8, 2
    x = rand(tokens, hidden, seed=1, dtype=dtype)
    # Experts 5 and 6 get no token; expert 0 gets more than one 16-row block.
    logits = rand(tokens, num_experts, seed=2)
    logits[:, 5:7] = -30.0
    logits[:20, 0] = 30.0
    routing = ref("moe").moe_route(logits, top_k, "softmax", True)
    up = rand(num_experts, (2 if gated else 1) * inter, hidden, seed=3, dtype=dtype) * 0.2
    down = rand(num_experts, hidden, inter, seed=4, dtype=dtype) * 0.2
    want = ref("moe").moe_experts(x, routing, up, down, activation, gated)
    got = twin("moe").moe_experts(x, routing, up, down, activation, gated)
    return check(got, want, dtype, scale=5)


# ------------------------------------------------------------------------------------- state rows


@case(component=["conv", "ssm"], dtype=[torch.float32, torch.bfloat16])
def gather_state_rows(component: str, dtype: torch.dtype) -> int:
    shape = (40, 3) if component == "conv" else (4, 16, 16)
    pool = rand(9, *shape, seed=1, dtype=dtype)
    slots = idx([7, 0, 3, 3])
    return check(
        twin("state_rows").gather_state_rows(pool, slots), ref("state_rows").gather_state_rows(pool, slots), dtype
    )


@case(source=["batch", "expanded-capture", "float32-into-bf16"])
def scatter_state_rows(source: str) -> int:
    dtype = torch.bfloat16 if source == "float32-into-bf16" else torch.float32
    pool = rand(9, 4, 16, 8, seed=1, dtype=dtype)
    want = pool.clone()
    if source == "expanded-capture":
        # One state copied to several capture slots, as run_prefill writes it.
        slots, rows = idx([2, 6, 8]), rand(1, 4, 16, 8, seed=2).expand(3, 4, 16, 8)
    else:
        slots, rows = idx([5, 1]), rand(2, 4, 16, 8, seed=3)
    ref("state_rows").scatter_state_rows(want, slots, rows)
    twin("state_rows").scatter_state_rows(pool, slots, rows)
    return check(pool, want, dtype)


# ------------------------------------------------------------------------ whole model, dispatched


@case(architecture=["NemotronH", "Qwen3Next", "Jamba", "Lfm2"])
def model_prefill_decode(architecture: str) -> int:
    """A tiny random checkpoint through the worker's model code, pools and dispatch: the twins
    (HIMAMBA_KERNELS=triton) against the references, on ragged prefills, a prefix extension and
    batched decode steps, logits compared at every step."""
    import os
    import sys
    import tempfile
    from pathlib import Path

    from himamba.kernels import dispatch
    from himamba.services.worker.loader import load_model
    from tests.worker.harness import Harness
    from tests.worker.hf_reference import save_tiny

    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(save_tiny(architecture, Path(tmp) / "hf"), device=DEVICE)
    prompts = [[(5 * i + 7 * j) % 200 + 1 for j in range(n)] for i, n in enumerate((12, 4, 20))]
    steps = {}
    for mode in ("reference", "triton"):
        os.environ[dispatch.KERNELS_ENV] = mode
        dispatch.kernels_mode.cache_clear()
        try:
            harness = Harness(model, num_pages=64, num_state_slots=8, device=DEVICE)
            seqs = [harness.new_sequence() for _ in prompts]
            logits = [
                harness.prefill(seqs, [p[:-3] for p in prompts]),
                harness.prefill(seqs, [p[-3:] for p in prompts]),
            ]
            for step in range(2):
                logits.append(harness.decode(seqs, [(11 * step + i) % 200 + 1 for i in range(len(seqs))]))
            steps[mode] = logits
        finally:
            del os.environ[dispatch.KERNELS_ENV]
            dispatch.kernels_mode.cache_clear()
    assert "himamba.kernels.triton.attention" in sys.modules  # the twins really ran
    count = 0
    for got, want in zip(steps["triton"], steps["reference"], strict=True):
        count += check(got, want, scale=25)
    return count


# ------------------------------------------------------------------------------ varlen prefill
# Three sequences packed on one token axis, one with a cached prefix (its initial state in its slot),
# and captures at page boundaries (16, 32) and one either side, inside chunks, and twice at one offset:
# every twin against `segmented` over the reference ops (a prefill of exactly that prefix).
VARLEN_LENS = [5, 40, 19]
VARLEN_PREFIX = [0, 16, 3]
VARLEN_SLOTS = [7, 2, 5]
VARLEN_CAPTURES = [[(4, 0), (5, 12)], [(15, 1), (16, 3), (17, 4), (23, 6), (32, 8)], [(1, 9), (18, 10), (18, 11)]]
VARLEN_POOL = 14


def _varlen(layout: str) -> tuple[Any, torch.Tensor]:
    from himamba.kernels.varlen import make_varlen

    captures = VARLEN_CAPTURES if layout == "captures" else [[], [], []]
    return make_varlen(VARLEN_LENS, VARLEN_PREFIX, captures, DEVICE), idx(VARLEN_SLOTS)


def _segmented() -> Any:
    return importlib.import_module("himamba.kernels.segmented")


def _pools(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    pool = rand(VARLEN_POOL, *shape, seed=seed, dtype=dtype)
    return pool, pool.clone()


@case(layout=["captures", "plain"], dtype=[torch.float32, torch.float16])
def causal_conv1d_varlen(layout: str, dtype: torch.dtype) -> int:
    v, slots = _varlen(layout)
    channels, width = 40, 4
    x = columns(rand(v.num_tokens, channels, seed=1, dtype=dtype), 24, seed=2)
    w, bias = rand(channels, width, seed=3, dtype=dtype), rand(channels, seed=4, dtype=dtype)
    want_pool, got_pool = _pools((channels, width - 1), seed=5, dtype=dtype)
    want = _segmented().conv1d_varlen(ref("conv1d").causal_conv1d, x, w, bias, want_pool, slots, v, "silu")
    got = twin("conv1d").causal_conv1d_varlen(x, w, bias, got_pool, slots, v, "silu")
    return check(got, want, dtype) + check(got_pool, want_pool, dtype)


@case(layout=["captures", "plain"], groups=[1, 2])
def ssd_scan_varlen(layout: str, groups: int) -> int:
    v, slots = _varlen(layout)
    args = _ssd_inputs(1, v.num_tokens, 4, 16, groups)
    packed = [args[n][0] for n in ("x", "dt", "A", "B", "C")]
    packed[2] = args["A"]
    want_pool, got_pool = _pools((4, 16, 16), seed=9)
    rest = (16, args["D"], args["dt_bias"], True, (0.0, float("inf")))
    want = _segmented().ssd_scan_varlen(ref("ssd").ssd_scan, *packed, *rest, want_pool, slots, v)
    got = twin("ssd").ssd_scan_varlen(*packed, *rest, got_pool, slots, v)
    return check(got, want, scale=5) + check(got_pool, want_pool, scale=5)


@case(layout=["captures", "plain"], channels=[24])
def selective_scan_varlen(layout: str, channels: int) -> int:
    v, slots = _varlen(layout)
    args = _mamba1_inputs(1, v.num_tokens, channels)
    packed = [args["u"][0], args["delta"][0], args["A"], args["B"][0], args["C"][0], args["D"], args["z"][0]]
    want_pool, got_pool = _pools((channels, 16), seed=9)
    want = _segmented().selective_scan_varlen(
        ref("selective_scan").selective_scan, *packed, args["delta_bias"], True, want_pool, slots, v
    )
    got = twin("selective_scan").selective_scan_varlen(*packed, args["delta_bias"], True, got_pool, slots, v)
    return check(got, want, scale=5) + check(got_pool, want_pool, scale=5)


@case(layout=["captures", "plain"], heads=["2:4"])
def chunk_gated_delta_rule_varlen(layout: str, heads: str) -> int:
    v, slots = _varlen(layout)
    k_heads, v_heads = map(int, heads.split(":"))
    q, k, val, g, beta, _ = _delta_inputs(1, v.num_tokens, k_heads, v_heads, 16, 48)
    q, k, val, g, beta = (t[0] for t in (q, k, val, g, beta))
    want_pool, got_pool = _pools((v_heads, 16, 48), seed=9)
    want_pool.mul_(0.1), got_pool.mul_(0.1)
    want = _segmented().gated_delta_rule_varlen(
        ref("delta_rule").chunk_gated_delta_rule, q, k, val, g, beta, 16, want_pool, slots, v, True, None
    )
    got = twin("delta_rule").chunk_gated_delta_rule_varlen(q, k, val, g, beta, 16, got_pool, slots, v, True, None)
    return check(got, want, scale=10) + check(got_pool, want_pool, scale=10)


@case(gqa=["8:2", "4:4"], head_dim=[64])
def paged_attention_prefill_varlen(gqa: str, head_dim: int) -> int:
    v, _ = _varlen("plain")
    q_heads, kv_heads = map(int, gqa.split(":"))
    k_cache, v_cache = _pool(kv_heads, head_dim, torch.float32)
    width = max(p + n for p, n in zip(VARLEN_PREFIX, VARLEN_LENS, strict=True)) + 3
    table = torch.stack([_slots(width, seed=20 + i) for i in range(len(VARLEN_LENS))])
    q = rand(v.num_tokens, q_heads, head_dim, seed=13)
    scale = head_dim**-0.5
    want = _segmented().attention_prefill_varlen(
        ref("attention").paged_attention_prefill, q, k_cache, v_cache, table, v, scale
    )
    got = twin("attention").paged_attention_prefill_varlen(q, k_cache, v_cache, table, v, scale)
    return check(got, want, scale=5)
