"""The public ops keep their references' exact signatures, so other implementations can drop in."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

import himamba.kernels as kernels
from himamba.kernels import dispatch, segmented, varlen
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

# Varlen prefill ops: their reference is `segmented`'s loop over the per-segment op (its first parameter).
VARLEN = {
    "causal_conv1d_varlen": segmented.conv1d_varlen,
    "ssd_scan_varlen": segmented.ssd_scan_varlen,
    "selective_scan_varlen": segmented.selective_scan_varlen,
    "chunk_gated_delta_rule_varlen": segmented.gated_delta_rule_varlen,
    "paged_attention_prefill_varlen": segmented.attention_prefill_varlen,
}
LAYOUT = {"Varlen": varlen.Varlen, "make_varlen": varlen.make_varlen}


@pytest.mark.parametrize("name", sorted(VARLEN))
def test_varlen_op_takes_what_its_segment_loop_takes(name: str) -> None:
    loop = list(inspect.signature(VARLEN[name]).parameters.values())[1:]
    op = list(inspect.signature(getattr(dispatch, name)).parameters.values())
    assert [(p.name, p.annotation) for p in op] == [(p.name, p.annotation) for p in loop]
    assert getattr(kernels, name) is getattr(dispatch, name)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_dispatch_signature_equals_reference(name: str) -> None:
    assert inspect.signature(getattr(dispatch, name)) == inspect.signature(REFERENCES[name])
    assert getattr(kernels, name) is getattr(dispatch, name)


def test_package_exports_every_op_and_result_type() -> None:
    assert set(kernels.__all__) == set(REFERENCES) | set(RESULT_TYPES) | set(VARLEN) | set(LAYOUT)
    for name, cls in (RESULT_TYPES | LAYOUT).items():
        assert getattr(kernels, name) is cls


class _Device:
    """A stand-in for a tensor's device flag: CUDA tensors cannot be made on a CPU-only machine."""

    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda


@pytest.fixture
def kernels_env(monkeypatch: pytest.MonkeyPatch):
    """Set HIMAMBA_KERNELS for one test; dispatch reads it once per process, so clear that cache."""

    def set_mode(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(dispatch.KERNELS_ENV, raising=False)
        else:
            monkeypatch.setenv(dispatch.KERNELS_ENV, value)
        dispatch.kernels_mode.cache_clear()

    yield set_mode
    monkeypatch.delenv(dispatch.KERNELS_ENV, raising=False)
    dispatch.kernels_mode.cache_clear()


@pytest.mark.parametrize("mode", [None, "auto", "reference"])
def test_cpu_inputs_always_take_the_reference(kernels_env, mode: str | None) -> None:
    kernels_env(mode)
    assert not dispatch.uses_triton(_Device(False))


def test_cuda_inputs_take_the_twin_when_triton_is_installed(kernels_env, monkeypatch: pytest.MonkeyPatch) -> None:
    for installed in (True, False):
        monkeypatch.setattr(dispatch, "triton_installed", lambda installed=installed: installed)
        kernels_env(None)
        assert dispatch.uses_triton(_Device(True)) is installed
        kernels_env("reference")
        assert not dispatch.uses_triton(_Device(True))


def test_forcing_triton_without_it_is_an_error(kernels_env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "triton_installed", lambda: False)
    kernels_env("triton")
    with pytest.raises(RuntimeError, match="triton is not installed"):
        dispatch.uses_triton(_Device(True))
    assert dispatch.uses_triton(_Device(False))  # on CPU: the interpreter's test mode


def test_an_unknown_kernels_mode_is_refused(kernels_env) -> None:
    kernels_env("cuda")
    with pytest.raises(ValueError, match="HIMAMBA_KERNELS must be one of auto, reference, triton, native, got 'cuda'"):
        kernels.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-5)


def test_every_op_has_a_twin_with_its_signature() -> None:
    """Each op's Triton twin exists with the reference's exact signature (read from source, so
    this process never imports triton)."""
    import ast
    from pathlib import Path

    folder = Path(dispatch.__file__).parent / "triton"
    twins = {}
    for path in folder.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                twins[node.name] = ast.unparse(node.args)
    for name, fn in REFERENCES.items():
        source = inspect.getsource(fn)
        ref_args = ast.unparse(ast.parse(source.strip()).body[0].args)
        assert twins.get(name) == ref_args, name


def test_cpu_processes_never_import_triton() -> None:
    """Every service module imported and every op run on CPU tensors: triton stays out of sys.modules."""
    import subprocess
    import sys

    script = """
import importlib, pkgutil, sys
import torch
import himamba.services as services
for m in pkgutil.walk_packages(services.__path__, "himamba.services."):
    importlib.import_module(m.name)
import himamba.kernels as k
x = torch.randn(3, 8)
k.rms_norm(x, torch.ones(8), 1e-5)
k.gated_rms_norm(x, x, torch.ones(8), 1e-5, 4)
k.causal_conv1d(torch.randn(1, 8, 5), torch.randn(8, 4), None, None)
k.causal_conv1d_update(x, torch.randn(3, 8, 3), torch.randn(8, 4), None)
pool = torch.zeros(4, 8)
k.scatter_state_rows(pool, torch.tensor([1, 2, 3]), x)
k.gather_state_rows(pool, torch.tensor([3]))
print(sorted(n for n in sys.modules if n == "triton" or n.startswith(("triton.", "himamba.kernels.triton"))))
"""
    env = {k: v for k, v in os.environ.items() if k not in (dispatch.KERNELS_ENV, "TRITON_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
