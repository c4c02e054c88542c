"""The one place that chooses an implementation for each kernel: the Triton twin, the native CPU
kernel or the PyTorch reference.

Every function here has the exact signature (and contract) of its reference in
`himamba.kernels.reference`, so callers never import an implementation directly.

The choice is made per call from the inputs: CUDA tensors with triton installed get the twin
in `himamba.kernels.triton.<family>` (imported on first use, so a CPU process never imports
triton); CPU tensors get the native kernel of `himamba.kernels.native` where there is one, it
takes the tensors (float32) and the library was built (`native.build`); anything else the
reference. The environment variable HIMAMBA_KERNELS overrides it: "reference" forces the
reference everywhere (to debug a GPU run, or to compare), "triton" forces the twins everywhere
(on CPU only under TRITON_INTERPRET=1, for testing), "native" requires the native library on
CPU (an error if it could not be built), "auto" (the default) chooses.

Code outside the kernels that differs between CPU and CUDA asks `cuda_path`, which
HIMAMBA_CUDA_PATH=1 forces to the CUDA branch on CPU tensors: with HIMAMBA_KERNELS=triton and
TRITON_INTERPRET=1 a CPU process then runs what a GPU would, to count its launches and syncs.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from types import ModuleType

from torch import Tensor

# cuda_path and the variables are re-exported: callers ask the dispatcher which path they are on.
from .code_path import CUDA_PATH_ENV, KERNEL_CHOICES, KERNELS_ENV, cuda_path, kernels_mode  # noqa: F401
from .native import attention as _native_attention
from .native import conv1d as _native_conv1d
from .native import delta_rule as _native_delta_rule
from .native import linear as _native_linear
from .native import moe as _native_moe
from .native import norm as _native_norm
from .native import selective_scan as _native_selective_scan
from .native import ssd as _native_ssd
from .native.build import native_build
from .native.linear import PanelWeight
from .native.moe import PackedExperts
from .reference import attention as _attention
from .reference import conv1d as _conv1d
from .reference import delta_rule as _delta_rule
from .reference import moe as _moe
from .reference import norm as _norm
from .reference import selective_scan as _selective_scan
from .reference import ssd as _ssd
from .reference import state_rows as _state_rows
from .reference.conv1d import ConvResult
from .reference.delta_rule import DeltaResult
from .reference.moe import Routing
from .reference.ssd import ScanResult
from .segmented import (
    attention_prefill_varlen as _attention_by_sequence,
)
from .segmented import (
    conv1d_varlen as _conv1d_by_segments,
)
from .segmented import (
    gated_delta_rule_varlen as _delta_rule_by_segments,
)
from .segmented import (
    selective_scan_varlen as _selective_scan_by_segments,
)
from .segmented import (
    ssd_scan_varlen as _ssd_scan_by_segments,
)
from .varlen import Varlen


@functools.cache
def triton_installed() -> bool:
    """Whether triton can be imported (looked up once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def uses_triton(x: Tensor) -> bool:
    """Whether an op whose main input is x runs the Triton twin (see the module docstring)."""
    mode = kernels_mode()
    if not x.is_cuda:
        return mode == "triton"
    if mode == "triton" and not triton_installed():
        raise RuntimeError(f"{KERNELS_ENV}=triton but triton is not installed")
    return mode != "reference" and triton_installed()


def _native_built() -> bool:
    """Whether the native library is loaded (built on first call); with HIMAMBA_KERNELS=native, an
    error when it could not be."""
    built = native_build()
    if built.library is None and kernels_mode() == "native":
        raise RuntimeError(f"{KERNELS_ENV}=native but the native kernels are {built.detail}")
    return built.library is not None


def uses_native(x: Tensor) -> bool:
    """Whether an op whose main input is x runs its native CPU kernel, where one takes the inputs
    (see the module docstring)."""
    return x.device.type == "cpu" and kernels_mode() not in ("reference", "triton") and _native_built()


def describe_cpu_kernels() -> str:
    """What CPU tensors run, in words (for logs and bench reports); builds the native library
    first if this process has not yet."""
    mode = kernels_mode()
    if mode in ("reference", "triton"):
        return f"{mode} ({KERNELS_ENV}={mode})"
    if not _native_built():
        return f"PyTorch reference (native kernels {native_build().detail})"
    return f"native where one exists, else the PyTorch reference; {native_build().detail}"


def pack_linear(weight: Tensor) -> PanelWeight | None:
    """A projection weight [out, in] packed once for `packed_linear` (the native CPU product, see
    `native.linear`), or None where it does not apply: not a float32 CPU matrix, or no native kernels."""
    if uses_native(weight) and _native_linear.supports(weight):
        return _native_linear.pack(weight)
    return None


def packed_linear(x: Tensor, weight: PanelWeight, bias: Tensor | None) -> Tensor:
    """`F.linear(x, W, bias)` with W packed by `pack_linear`."""
    return _native_linear.linear(x, weight, bias)


@functools.cache
def _twin(family: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.triton.{family}")


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    initial_state: Tensor | None,
    activation: str | None = "silu",
) -> ConvResult:
    """Causal depthwise conv of a segment; see `reference.conv1d.causal_conv1d`."""
    if uses_triton(x):
        return _twin("conv1d").causal_conv1d(x, weight, bias, initial_state, activation)
    if uses_native(x) and _native_conv1d.supports(x, weight, bias, initial_state):
        return _native_conv1d.causal_conv1d(x, weight, bias, initial_state, activation)
    return _conv1d.causal_conv1d(x, weight, bias, initial_state, activation)


def causal_conv1d_update(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None = "silu",
    conv_state_indices: Tensor | None = None,
) -> Tensor:
    """One decode step of the conv, updating conv_state (with `conv_state_indices`: the pool rows
    they name) in place; see `reference.conv1d`."""
    if uses_triton(x):
        return _twin("conv1d").causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices)
    if conv_state_indices is None and uses_native(x) and _native_conv1d.supports_update(x, conv_state, weight, bias):
        return _native_conv1d.causal_conv1d_update(x, conv_state, weight, bias, activation)
    return _conv1d.causal_conv1d_update(x, conv_state, weight, bias, activation, conv_state_indices)


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
    """Mamba2 chunked scan (prefill); see `reference.ssd.ssd_scan`."""
    if uses_triton(x):
        return _twin("ssd").ssd_scan(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, initial_state)
    if uses_native(x) and _native_ssd.supports_scan(x, dt, A, B, C, D, dt_bias, initial_state):
        return _native_ssd.ssd_scan(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, initial_state)
    return _ssd.ssd_scan(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, initial_state)


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
    """One decode step of the Mamba2 recurrence, updating state (with `state_batch_indices`: the
    pool rows they name) in place; see `reference.ssd`."""
    args = (state, x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit)
    if uses_triton(x):
        return _twin("ssd").selective_state_update(*args, state_batch_indices)
    if (
        state_batch_indices is None
        and uses_native(x)
        and _native_ssd.supports_state_update(state, x, dt, A, B, C, D, dt_bias)
    ):
        return _native_ssd.selective_state_update(*args)
    return _ssd.selective_state_update(*args, state_batch_indices)


def rms_norm(x: Tensor, weight: Tensor, eps: float, multiply_in_float32: bool = False) -> Tensor:
    """RMSNorm over the last dim; see `reference.norm.rms_norm` for `multiply_in_float32`."""
    if uses_triton(x):
        return _twin("norm").rms_norm(x, weight, eps, multiply_in_float32)
    if uses_native(x) and _native_norm.supports(x, weight):
        return _native_norm.rms_norm(x, weight, eps, multiply_in_float32)
    return _norm.rms_norm(x, weight, eps, multiply_in_float32)


def gated_rms_norm(x: Tensor, gate: Tensor | None, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """Gated, grouped RMSNorm of Mamba2 mixers; see `reference.norm.gated_rms_norm`."""
    if uses_triton(x):
        return _twin("norm").gated_rms_norm(x, gate, weight, eps, group_size)
    if uses_native(x) and _native_norm.supports(x, weight, gate):
        return _native_norm.gated_rms_norm(x, gate, weight, eps, group_size)
    return _norm.gated_rms_norm(x, gate, weight, eps, group_size)


def paged_attention_prefill(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, seq_slots: Tensor, prefix_len: int, scale: float
) -> Tensor:
    """Causal attention of one sequence's new tokens over the paged pool; see `reference.attention`."""
    if uses_triton(q):
        return _twin("attention").paged_attention_prefill(q, k_cache, v_cache, seq_slots, prefix_len, scale)
    if uses_native(q) and _native_attention.supports(q, k_cache, v_cache):
        return _native_attention.paged_attention_prefill(q, k_cache, v_cache, seq_slots, prefix_len, scale)
    return _attention.paged_attention_prefill(q, k_cache, v_cache, seq_slots, prefix_len, scale)


def paged_attention_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, seq_lens: Tensor, scale: float
) -> Tensor:
    """Attention of one new token per sequence over the paged pool; see `reference.attention`."""
    if uses_triton(q):
        return _twin("attention").paged_attention_decode(q, k_cache, v_cache, slot_table, seq_lens, scale)
    if uses_native(q) and _native_attention.supports(q, k_cache, v_cache):
        return _native_attention.paged_attention_decode(q, k_cache, v_cache, slot_table, seq_lens, scale)
    return _attention.paged_attention_decode(q, k_cache, v_cache, slot_table, seq_lens, scale)


def write_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Store new K/V at token slots of the layer's pool; see `reference.attention.write_kv`."""
    if uses_triton(k):
        _twin("attention").write_kv(k_cache, v_cache, slots, k, v)
        return
    _attention.write_kv(k_cache, v_cache, slots, k, v)


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
    """Mamba1 selective scan (prefill); see `reference.selective_scan.selective_scan`."""
    if uses_triton(u):
        return _twin("selective_scan").selective_scan(
            u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state
        )
    return _selective_scan.selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state)


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
    """One decode step of the Mamba1 recurrence, updating state (with `state_batch_indices`: the
    pool rows they name) in place; see `reference.selective_scan`."""
    args = (state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)
    if uses_triton(x):
        return _twin("selective_scan").selective_state_update_mamba1(*args)
    return _selective_scan.selective_state_update_mamba1(*args)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> DeltaResult:
    """Gated delta rule over a segment (prefill); see `reference.delta_rule.chunk_gated_delta_rule`."""
    if uses_triton(q):
        return _twin("delta_rule").chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size, initial_state, use_qk_l2norm, scale
        )
    return _delta_rule.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size, initial_state, use_qk_l2norm, scale)


def recurrent_gated_delta_rule_update(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
    state_batch_indices: Tensor | None = None,
) -> Tensor:
    """One decode step of the gated delta rule, updating state (with `state_batch_indices`: the pool
    rows they name) in place; see `reference.delta_rule`."""
    args = (q, k, v, g, beta, state, use_qk_l2norm, scale, state_batch_indices)
    if uses_triton(q):
        return _twin("delta_rule").recurrent_gated_delta_rule_update(*args)
    return _delta_rule.recurrent_gated_delta_rule_update(*args)


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
    """Top-k expert choice and weights per token; see `reference.moe.moe_route`."""
    if uses_triton(router_logits):
        return _twin("moe").moe_route(
            router_logits, top_k, scoring, norm_topk_prob, bias, routed_scaling_factor, n_group, topk_group
        )
    return _moe.moe_route(
        router_logits, top_k, scoring, norm_topk_prob, bias, routed_scaling_factor, n_group, topk_group
    )


def moe_experts(
    x: Tensor,
    routing: Routing,
    gate_up_weights: Tensor,
    down_weights: Tensor,
    activation: str,
    gated: bool = True,
) -> Tensor:
    """The routed experts' weighted feed-forward; see `reference.moe.moe_experts`."""
    if uses_triton(x):
        return _twin("moe").moe_experts(x, routing, gate_up_weights, down_weights, activation, gated)
    return _moe.moe_experts(x, routing, gate_up_weights, down_weights, activation, gated)


def pack_experts(gate_up_weights: Tensor, down_weights: Tensor, gated: bool) -> PackedExperts | None:
    """Expert weights packed once for `packed_moe_experts` (the native CPU products, see
    `native.moe`), or None where that does not apply: not float32 CPU weights, or no native kernels."""
    if uses_native(gate_up_weights) and _native_moe.supports(gate_up_weights, down_weights):
        return _native_moe.pack(gate_up_weights, down_weights, gated)
    return None


def packed_moe_experts(x: Tensor, routing: Routing, packed: PackedExperts, activation: str) -> Tensor:
    """`moe_experts` with the experts packed by `pack_experts`."""
    return _native_moe.moe_experts(x, routing, packed, activation)


def gather_state_rows(pool: Tensor, slots: Tensor) -> Tensor:
    """Copies of the state pool's rows at slots; see `reference.state_rows.gather_state_rows`."""
    if uses_triton(pool):
        return _twin("state_rows").gather_state_rows(pool, slots)
    return _state_rows.gather_state_rows(pool, slots)


def scatter_state_rows(pool: Tensor, slots: Tensor, rows: Tensor) -> None:
    """Store rows at the state pool's slots in place; see `reference.state_rows.scatter_state_rows`."""
    if uses_triton(pool):
        _twin("state_rows").scatter_state_rows(pool, slots, rows)
        return
    _state_rows.scatter_state_rows(pool, slots, rows)


# Varlen prefill: one call for every sequence of a step (see `varlen`). The Triton twins run it in one
# launch, the native CPU kernels in one parallel region; otherwise (the PyTorch references: other dtypes,
# HIMAMBA_KERNELS=reference) `segmented` runs the per-segment ops above.


def causal_conv1d_varlen(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
    activation: str | None = "silu",
) -> Tensor:
    """Causal depthwise conv of a packed batch x [T, D] -> [T, D], each sequence from its slot of
    `conv_pool` [slots, D, K-1] (or zeros), captures and final states written there."""
    if uses_triton(x):
        return _twin("conv1d").causal_conv1d_varlen(x, weight, bias, conv_pool, state_slots, v, activation)
    if uses_native(x) and _native_conv1d.supports_varlen(x, weight, bias, conv_pool):
        return _native_conv1d.causal_conv1d_varlen(x, weight, bias, conv_pool, state_slots, v, activation)
    return _conv1d_by_segments(causal_conv1d, x, weight, bias, conv_pool, state_slots, v, activation)


def ssd_scan_varlen(
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
    """Mamba2 scan of a packed batch (x [T, H, P], dt [T, H], B/C [T, G, N]) -> y [T, H, P], each
    sequence from its slot of `ssm_pool` [slots, H, P, N] (or zeros), captures and final states there."""
    args = (x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, ssm_pool, state_slots, v)
    if uses_triton(x):
        return _twin("ssd").ssd_scan_varlen(*args)
    if uses_native(x) and _native_ssd.supports_scan_varlen(x, dt, A, B, C, ssm_pool, D, dt_bias):
        return _native_ssd.ssd_scan_varlen(*args)
    return _ssd_scan_by_segments(ssd_scan, *args)


def selective_scan_varlen(
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
    """Mamba1 scan of a packed batch (u, delta, z [T, D]; B, C [T, N]) -> y [T, D], each sequence from
    its slot of `ssm_pool` [slots, D, N] (or zeros), captures and final states there."""
    args = (u, delta, A, B, C, D, z, delta_bias, delta_softplus, ssm_pool, state_slots, v)
    if uses_triton(u):
        return _twin("selective_scan").selective_scan_varlen(*args)
    if uses_native(u) and _native_selective_scan.supports_varlen(u, delta, A, B, C, ssm_pool, D, z, delta_bias):
        return _native_selective_scan.selective_scan_varlen(*args)
    return _selective_scan_by_segments(selective_scan, *args)


def chunk_gated_delta_rule_varlen(
    q: Tensor,
    k: Tensor,
    val: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int,
    state_pool: Tensor,
    state_slots: Tensor,
    v: Varlen,
    use_qk_l2norm: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Gated delta rule of a packed batch (q, k [T, Hk, Dk]; val [T, Hv, Dv]; g, beta [T, Hv]) ->
    [T, Hv, Dv], each sequence from its slot of `state_pool` [slots, Hv, Dk, Dv] (or zeros)."""
    args = (q, k, val, g, beta, chunk_size, state_pool, state_slots, v, use_qk_l2norm, scale)
    if uses_triton(q):
        return _twin("delta_rule").chunk_gated_delta_rule_varlen(*args)
    if uses_native(q) and _native_delta_rule.supports_varlen(q, k, val, g, beta, state_pool):
        return _native_delta_rule.gated_delta_rule_varlen(*args)
    return _delta_rule_by_segments(chunk_gated_delta_rule, *args)


def paged_attention_prefill_varlen(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, v: Varlen, scale: float
) -> Tensor:
    """Causal attention of a packed batch's new tokens q [T, Hq, Dh] over each sequence's context
    (row b of `slot_table`: its token slots, prefix then new)."""
    if uses_triton(q):
        return _twin("attention").paged_attention_prefill_varlen(q, k_cache, v_cache, slot_table, v, scale)
    if uses_native(q) and _native_attention.supports(q, k_cache, v_cache):
        return _native_attention.paged_attention_prefill_varlen(q, k_cache, v_cache, slot_table, v, scale)
    return _attention_by_sequence(paged_attention_prefill, q, k_cache, v_cache, slot_table, v, scale)
