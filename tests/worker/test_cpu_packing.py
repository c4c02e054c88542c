"""Projection weights pre-packed for the CPU GEMM path (oneDNN, or the native panels): the same products
as the plain weight, packed at load by default, for tied heads and routed experts too, and never for
what cannot be packed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from himamba.kernels import Routing
from himamba.kernels.native.build import native_build
from himamba.services.worker.layers.cpu_packing import can_pack
from himamba.services.worker.layers.embedding import LMHead, VocabEmbedding
from himamba.services.worker.layers.linear import Linear
from himamba.services.worker.layers.moe import RoutedExperts, SoftmaxTopKRouter
from himamba.services.worker.layers.projected_attention import ProjectedAttention
from himamba.services.worker.loader import load_model
from tests.worker.harness import Harness
from tests.worker.hf_reference import save_tiny

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
CPU = torch.device("cpu")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (40, 48), (2, 5, 48)])
def test_a_packed_linear_computes_the_same_product(bias: bool, shape: tuple[int, ...]) -> None:
    layer = Linear(48, 80, bias, CPU, torch.float32)
    gen = torch.Generator().manual_seed(0)
    layer.weight.copy_(torch.randn(80, 48, generator=gen))
    if layer.bias is not None:
        layer.bias.copy_(torch.randn(80, generator=gen))
    x = torch.randn(shape, generator=gen)
    plain = layer(x)
    assert layer.pack_for_cpu()
    torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain, F.linear(x, layer.weight, layer.bias))


def test_a_tied_head_packs_the_embedding_table() -> None:
    emb = VocabEmbedding(100, 32, CPU, torch.float32)
    emb.weight.copy_(torch.randn(100, 32))
    head = LMHead(100, 32, CPU, torch.float32, tied_to=emb, logits_divisor=2.0)
    hidden = torch.randn(3, 32)
    plain = head(hidden)
    assert head.pack_for_cpu()
    torch.testing.assert_close(head(hidden), plain, rtol=1e-5, atol=1e-5)
    head.tie_to(emb)  # re-tying drops the packed copy: it would no longer follow the weight
    assert head._packed is None


def test_only_cpu_float_matrices_are_packed() -> None:
    assert can_pack(torch.empty(4, 4)) and can_pack(torch.empty(4, 4, dtype=torch.bfloat16))
    assert not can_pack(torch.empty(4, 4, dtype=torch.float16)) and not can_pack(torch.empty(4))
    layer = Linear(4, 4, False, CPU, torch.float16)
    assert not layer.pack_for_cpu() and layer._packed is None


def test_the_loader_packs_by_default_and_gives_the_same_tokens(tmp_path: Path) -> None:
    path = save_tiny("Bamba", tmp_path / "bamba")
    packed, plain = load_model(path), load_model(path, pack_cpu_weights=False)
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    # Each projection is packed on its own or, for q/k/v, inside its attention's one packed product.
    assert linears and all((m._packed is not None) != m._fused for m in linears) and packed.lm_head._packed is not None
    attentions = [m for m in packed.modules() if isinstance(m, ProjectedAttention)]
    assert attentions and all(m._qkv_packed is not None for m in attentions)
    assert sum(m._fused for m in linears) == 3 * len(attentions)
    assert all(m._packed is None for m in plain.modules() if isinstance(m, Linear))
    prompts = [[5, 9, 13, 2, 7], [1] * 40]
    assert Harness(packed).generate_greedy(prompts, 12) == Harness(plain).generate_greedy(prompts, 12)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tokens", [1, 9, 70])
def test_packed_qkv_is_the_three_projections(bias: bool, tokens: int) -> None:
    attn = ProjectedAttention(48, 48, 4, 2, 12, bias, CPU, torch.float32, q_per_head=2)
    gen = torch.Generator().manual_seed(tokens)
    for p in attn.parameters():
        p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(tokens, 48, generator=gen)
    plain = attn.project_qkv(x)
    assert attn.pack_for_cpu()
    assert not attn.q_proj.pack_for_cpu() and attn.q_proj._packed is None  # no second packed copy
    fused = attn.project_qkv(x)
    assert [t.shape for t in fused] == [(tokens, 96), (tokens, 24), (tokens, 24)]
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attn.k_proj(x), plain[1])  # the module itself still works, unpacked


@pytest.mark.parametrize("gated,activation", [(True, "silu"), (False, "relu2")])
@pytest.mark.parametrize("tokens", [1, 8, 33])
def test_packed_experts_compute_the_same_mixture(gated: bool, activation: str, tokens: int) -> None:
    if native_build().library is None:
        pytest.skip(f"native kernels {native_build().detail}")
    experts = RoutedExperts(6, 40, 24, activation, gated, CPU, torch.float32)
    router = SoftmaxTopKRouter(40, 6, 2, CPU, torch.float32)
    gen = torch.Generator().manual_seed(tokens)
    for p in [*experts.parameters(), *router.parameters()]:
        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(tokens, 40, generator=gen)
    routing = router(x)
    plain = experts(x, routing)
    assert experts.pack_for_cpu()
    torch.testing.assert_close(experts(x, routing), plain, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="routing.experts"):  # the packed path checks ids as the reference does
        experts(x, Routing(routing.weights, routing.experts + 6))


def test_experts_of_other_dtypes_stay_unpacked() -> None:
    experts = RoutedExperts(4, 16, 8, "silu", True, CPU, torch.bfloat16)
    assert not experts.pack_for_cpu() and experts._packed is None
