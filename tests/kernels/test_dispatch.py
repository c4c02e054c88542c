"""The public ops keep their references' exact signatures, so other implementations can drop in."""

from __future__ import annotations

import inspect

import pytest

import himamba.kernels as kernels
from himamba.kernels import dispatch
from himamba.kernels.reference import attention, conv1d, delta_rule, moe, norm, selective_scan, ssd, state_rows

REFERENCES = {
    "causal_conv1d": conv1d.causal_conv1d,
    "causal_conv1d_update": conv1d.causal_conv1d_update,
    "ssd_scan": ssd.ssd_scan,
    "selective_state_update": ssd.selective_state_update,
    "rms_norm": norm.rms_norm,
    "gated_rms_norm": norm.gated_rms_norm,
    "paged_attention_prefill": attention.paged_attention_prefill,
    "paged_attention_decode": attention.paged_attention_decode,
    "write_kv": attention.write_kv,
    "selective_scan": selective_scan.selective_scan,
    "selective_state_update_mamba1": selective_scan.selective_state_update_mamba1,
    "chunk_gated_delta_rule": delta_rule.chunk_gated_delta_rule,
    "recurrent_gated_delta_rule_update": delta_rule.recurrent_gated_delta_rule_update,
    "moe_route": moe.moe_route,
    "moe_experts": moe.moe_experts,
    "gather_state_rows": state_rows.gather_state_rows,
    "scatter_state_rows": state_rows.scatter_state_rows,
}
RESULT_TYPES = {
    "ConvResult": conv1d.ConvResult,
    "ScanResult": ssd.ScanResult,
    "DeltaResult": delta_rule.DeltaResult,
    "Routing": moe.Routing,
}


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_dispatch_signature_equals_reference(name: str) -> None:
    assert inspect.signature(getattr(dispatch, name)) == inspect.signature(REFERENCES[name])
    assert getattr(kernels, name) is getattr(dispatch, name)


def test_package_exports_every_op_and_result_type() -> None:
    assert set(kernels.__all__) == set(REFERENCES) | set(RESULT_TYPES)
    for name, cls in RESULT_TYPES.items():
        assert getattr(kernels, name) is cls
