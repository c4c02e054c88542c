"""Runs each MoE family's layer on the CUDA code path on CPU tensors and prints its launch and sync
counts as JSON: `python moe_launch_run.py`, with HIMAMBA_KERNELS=triton and TRITON_INTERPRET=1 set
by the caller (`test_moe_launches.py`) so that the pytest process never imports triton.

Each case also reruns the layer on the reference kernels and reports the largest difference, and
a control counts the reference's expert loop (which syncs and launches per expert), so that the
counter is shown to see what it must.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `tests.worker`

import torch

from himamba.kernels import dispatch
from himamba.kernels.reference import moe as reference_moe
from himamba.services.worker.models.granite_hybrid import GraniteHybridMoE
from himamba.services.worker.models.jamba import JambaMoE
from himamba.services.worker.models.nemotron_h import NemotronHMoE
from himamba.services.worker.models.qwen3_next import Qwen3NextMoE
from himamba.services.worker.launch_count import LaunchCount, StepCount

HIDDEN, INTER, TOP_K = 32, 16, 2


def build(family: str, experts: int) -> torch.nn.Module:
    cpu, f32 = torch.device("cpu"), torch.float32
    if family == "nemotron_h":
        cfg = SimpleNamespace(
            hidden_size=HIDDEN, n_routed_experts=experts, num_experts_per_tok=TOP_K, n_group=4, topk_group=2,
            norm_topk_prob=True, routed_scaling_factor=2.5, moe_latent_size=None, moe_intermediate_size=INTER,
            mlp_hidden_act="relu2", moe_shared_expert_intermediate_size=INTER, mlp_bias=False,
        )  # fmt: skip
        layer: torch.nn.Module = NemotronHMoE(cfg, cpu, f32)
    elif family == "qwen3_next":
        cfg = SimpleNamespace(
            hidden_size=HIDDEN, num_experts=experts, num_experts_per_tok=TOP_K, norm_topk_prob=True,
            moe_intermediate_size=INTER, hidden_act="silu", shared_expert_intermediate_size=INTER,
        )  # fmt: skip
        layer = Qwen3NextMoE(cfg, cpu, f32)
    elif family == "granite_hybrid":
        cfg = SimpleNamespace(
            hidden_size=HIDDEN, num_local_experts=experts, num_experts_per_tok=TOP_K, intermediate_size=INTER,
            hidden_act="silu",
        )  # fmt: skip
        layer = GraniteHybridMoE(cfg, cpu, f32)
    else:
        cfg = SimpleNamespace(
            hidden_size=HIDDEN, num_experts=experts, num_experts_per_tok=TOP_K, intermediate_size=INTER,
            hidden_act="silu",
        )  # fmt: skip
        layer = JambaMoE(cfg, cpu, f32)
    gen = torch.Generator().manual_seed(experts)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def _set_kernels(mode: str) -> None:
    os.environ[dispatch.KERNELS_ENV] = mode
    dispatch.kernels_mode.cache_clear()


def run_case(family: str, experts: int, tokens: int) -> dict:
    layer = build(family, experts)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        layer(x)  # first call outside the count: imports, the interpreter's rewrites
        assert dispatch.cuda_path(x)
        count = LaunchCount()
        with count:
            got = layer(x)
        counter = count.result()
        _set_kernels("reference")
        try:
            want = layer(x)
        finally:
            _set_kernels("triton")
    return {
        "family": family,
        "experts": experts,
        "tokens": tokens,
        "launches": counter.launches,
        "triton_launches": counter.triton_launches,
        "syncs": _sync_names(counter),
        "max_diff": float((got - want).abs().max()),
    }


def control(experts: int, tokens: int) -> dict:
    """The reference's expert loop, which a CUDA path must not run, counted the same way."""
    layer = build("jamba", experts)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    routing = reference_moe.Routing(
        torch.full((tokens, TOP_K), 0.5), torch.arange(tokens * TOP_K).remainder(experts).view(tokens, TOP_K)
    )
    count = LaunchCount()
    with torch.inference_mode(), count:
        reference_moe.moe_experts(x, routing, layer.experts.gate_up_proj, layer.experts.down_proj, "silu")
    counter = count.result()
    return {"experts": experts, "tokens": tokens, "launches": counter.launches, "syncs": _sync_names(counter)}


def _sync_names(count: StepCount) -> list[str]:
    return [s.op for s in count.syncs]


def main() -> None:
    if dispatch.kernels_mode() != "triton" or os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with HIMAMBA_KERNELS=triton TRITON_INTERPRET=1")
    cases = [
        run_case(family, experts, tokens)
        for family in ("nemotron_h", "qwen3_next", "granite_hybrid", "jamba")
        for experts in (8, 64)
        for tokens in (1, 32)
    ]
    controls = [control(experts, 32) for experts in (8, 64)]
    print(json.dumps({"cases": cases, "controls": controls}))


if __name__ == "__main__":
    main()
