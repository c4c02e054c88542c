"""Compute kernels of the worker: causal conv, Mamba2 SSD scan, RMS norms and paged attention.

Import ops from here; `dispatch` picks the implementation for the given tensors.
"""

from .dispatch import (
    ConvResult,
    ScanResult,
    causal_conv1d,
    causal_conv1d_update,
    gated_rms_norm,
    paged_attention_decode,
    paged_attention_prefill,
    rms_norm,
    selective_state_update,
    ssd_scan,
    write_kv,
)

__all__ = [
    "ConvResult",
    "ScanResult",
    "causal_conv1d",
    "causal_conv1d_update",
    "gated_rms_norm",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "selective_state_update",
    "ssd_scan",
    "write_kv",
]
