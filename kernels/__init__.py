"""Compute kernels of the worker: causal conv, Mamba2 SSD and Mamba1 selective scans, the gated delta
rule, RMS norms, paged attention and MoE routing/experts.

Import ops from here; `dispatch` picks the implementation for the given tensors: the PyTorch
reference (`kernels/reference/`), its Triton twin (`kernels/triton/`, CUDA) or, on CPU, its native
kernel where there is one (`kernels/native/`).
"""

from .dispatch import (
    ConvResult,
    DeltaResult,
    Routing,
    ScanResult,
    causal_conv1d,
    causal_conv1d_update,
    causal_conv1d_varlen,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_varlen,
    gated_rms_norm,
    gather_state_rows,
    moe_experts,
    moe_route,
    paged_attention_decode,
    paged_attention_prefill,
    paged_attention_prefill_varlen,
    recurrent_gated_delta_rule_update,
    rms_norm,
    scatter_state_rows,
    selective_scan,
    selective_scan_varlen,
    selective_state_update,
    selective_state_update_mamba1,
    ssd_scan,
    ssd_scan_varlen,
    write_kv,
)
from .varlen import Varlen, make_varlen

__all__ = [
    "ConvResult",
    "DeltaResult",
    "Routing",
    "ScanResult",
    "Varlen",
    "causal_conv1d",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_varlen",
    "gated_rms_norm",
    "gather_state_rows",
    "make_varlen",
    "moe_experts",
    "moe_route",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_attention_prefill_varlen",
    "recurrent_gated_delta_rule_update",
    "rms_norm",
    "scatter_state_rows",
    "selective_scan",
    "selective_scan_varlen",
    "selective_state_update",
    "selective_state_update_mamba1",
    "ssd_scan",
    "ssd_scan_varlen",
    "write_kv",
]
