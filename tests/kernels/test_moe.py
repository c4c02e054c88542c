"""moe_route / moe_experts against a per-token float64 specification and transformers' routers and experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from himamba.kernels import Routing, moe_experts, moe_route

TOL = {"rtol": 1e-5, "atol": 1e-6}


def naive_route(
    logits: torch.Tensor,
    top_k: int,
    scoring: str,
    norm: bool,
    bias: torch.Tensor | None,
    scale: float,
    n_group: int,
    topk_group: int,
) -> list[dict[int, float]]:
    """The specification, per token in float64: {expert: weight} of the chosen experts."""
    num_experts = logits.shape[1]
    per_group = num_experts // n_group
    chosen = []
    for row in logits.double():
        scores = torch.softmax(row, -1) if scoring == "softmax" else torch.sigmoid(row)
        choice = scores + (0 if bias is None else bias.double())
        groups = [sorted(choice[g * per_group : (g + 1) * per_group].tolist(), reverse=True) for g in range(n_group)]
        group_rank = sorted(range(n_group), key=lambda g: -sum(groups[g][:2]))
        eligible = [e for e in range(num_experts) if e // per_group in group_rank[:topk_group]]
        top = sorted(eligible, key=lambda e: -choice[e].item())[:top_k]
        weights = {e: scores[e].item() for e in top}
        total = sum(weights.values())
        chosen.append({e: (w / total if norm else w) * scale for e, w in weights.items()})
    return chosen


def as_dicts(routing: Routing) -> list[dict[int, float]]:
    pairs = zip(routing.weights.tolist(), routing.experts.tolist(), strict=True)
    return [dict(zip(e, w, strict=True)) for w, e in pairs]


def assert_same_routing(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    assert [set(g) for g in got] == [set(w) for w in want]
    for g, w in zip(got, want, strict=True):
        for e in w:
            assert g[e] == pytest.approx(w[e], rel=1e-5, abs=1e-7)


def logits_of(tokens: int, experts: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.mark.parametrize(
    "top_k,scoring,norm,use_bias,scale,n_group,topk_group",
    [
        (1, "softmax", False, False, 1.0, 1, 1),
        (2, "softmax", False, False, 1.0, 1, 1),  # Jamba
        (4, "softmax", True, False, 1.0, 1, 1),  # Qwen3-Next, GraniteMoeHybrid
        (2, "sigmoid", True, True, 2.5, 1, 1),
        (4, "sigmoid", True, True, 2.5, 4, 2),  # NemotronH / DeepSeek-V3
        (3, "sigmoid", False, True, 1.0, 8, 3),
        (2, "softmax", True, True, 1.0, 2, 1),
    ],
)
def test_route_matches_spec(
    top_k: int, scoring: str, norm: bool, use_bias: bool, scale: float, n_group: int, topk_group: int
) -> None:
    logits = logits_of(37, 16, seed=top_k * 10 + n_group)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(1)) * 0.5 if use_bias else None
    routing = moe_route(logits, top_k, scoring, norm, bias, scale, n_group, topk_group)
    assert isinstance(routing, Routing)
    assert routing.weights.shape == (37, top_k) and routing.weights.dtype == torch.float32
    assert routing.experts.shape == (37, top_k) and routing.experts.dtype == torch.int64
    assert_same_routing(as_dicts(routing), naive_route(logits, top_k, scoring, norm, bias, scale, n_group, topk_group))


def test_bias_steers_choice_but_not_weights() -> None:
    logits = logits_of(20, 8, seed=2)
    bias = torch.zeros(8)
    bias[5] = 10.0  # always chosen, yet weighted by its own sigmoid score only
    routing = moe_route(logits, 2, "sigmoid", False, bias)
    assert (routing.experts[:, 0] == 5).all()
    torch.testing.assert_close(routing.weights[:, 0], logits[:, 5].sigmoid(), **TOL)


def test_group_limit_keeps_experts_inside_best_groups() -> None:
    logits = logits_of(50, 16, seed=3)
    routing = moe_route(logits, 4, "sigmoid", True, None, 1.0, n_group=4, topk_group=1)
    groups = routing.experts // 4
    assert (groups == groups[:, :1]).all()


def naive_experts(
    x: torch.Tensor, routing: list[dict[int, float]], up: torch.Tensor, down: torch.Tensor, act, gated: bool
) -> torch.Tensor:
    """The specification, per token in float64."""
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, chosen in enumerate(routing):
        for e, w in chosen.items():
            h = up[e].double() @ x[t].double()
            h = act(h[:inter]) * h[inter:] if gated else act(h)
            out[t] += w * (down[e].double() @ h)
    return out


ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu2": lambda h: F.relu(h) ** 2,
    "gelu_pytorch_tanh": lambda h: F.gelu(h, approximate="tanh"),
}


@pytest.mark.parametrize("activation", sorted(ACTS))
@pytest.mark.parametrize("gated", [True, False])
def test_experts_match_spec(activation: str, gated: bool) -> None:
    g = torch.Generator().manual_seed(4)
    tokens, hidden, inter, experts = 23, 12, 10, 6
    x = torch.randn(tokens, hidden, generator=g)
    up = torch.randn(experts, (2 if gated else 1) * inter, hidden, generator=g) * 0.3
    down = torch.randn(experts, hidden, inter, generator=g) * 0.3
    routing = moe_route(logits_of(tokens, experts, seed=5), 2, "softmax", True)
    out = moe_experts(x, routing, up, down, activation, gated)
    assert out.shape == x.shape and out.dtype == torch.float32
    want = naive_experts(x, as_dicts(routing), up, down, ACTS[activation], gated)
    torch.testing.assert_close(out.double(), want, **TOL)


def test_experts_skip_unused_experts_and_keep_dtype() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 8, generator=g).bfloat16()
    up = torch.randn(4, 12, 8, generator=g).bfloat16()
    down = torch.randn(4, 8, 6, generator=g).bfloat16()
    routing = Routing(torch.ones(5, 1), torch.full((5, 1), 2, dtype=torch.int64))
    out = moe_experts(x, routing, up, down, "silu")
    assert out.dtype == torch.bfloat16
    want = naive_experts(x.float(), as_dicts(routing), up.float(), down.float(), F.silu, True)
    torch.testing.assert_close(out.double(), want, rtol=5e-2, atol=5e-2)
    empty = moe_experts(x[:0], Routing(torch.ones(0, 1), torch.zeros(0, 1, dtype=torch.int64)), up, down, "silu")
    assert empty.shape == (0, 8)


def test_bad_input_raises_value_error() -> None:
    logits = logits_of(4, 8, seed=7)
    with pytest.raises(ValueError, match="scoring"):
        moe_route(logits, 2, "tanh", False)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, 9, "softmax", False)
    with pytest.raises(ValueError, match="top_k"):
        moe_route(logits, 3, "sigmoid", False, n_group=4, topk_group=1)  # only 2 experts eligible
    with pytest.raises(ValueError, match="n_group"):
        moe_route(logits, 2, "sigmoid", False, n_group=3)
    with pytest.raises(ValueError, match="topk_group"):
        moe_route(logits, 2, "sigmoid", False, n_group=2, topk_group=3)
    with pytest.raises(ValueError, match="bias"):
        moe_route(logits, 2, "sigmoid", False, bias=torch.zeros(7))
    x, up, down = torch.randn(4, 6), torch.randn(8, 10, 6), torch.randn(8, 6, 5)
    routing = moe_route(logits, 2, "softmax", True)
    with pytest.raises(ValueError, match="activation"):
        moe_experts(x, routing, up, down, "tanh")
    with pytest.raises(ValueError, match="gate_up_weights"):
        moe_experts(x, routing, up, down, "silu", gated=False)
    with pytest.raises(ValueError, match="down_weights"):
        moe_experts(x, routing, up, down[:, :5], "silu")
    with pytest.raises(ValueError, match="routing"):
        moe_experts(x[:3], routing, up, down, "silu")
    with pytest.raises(ValueError, match="routing.experts"):
        moe_experts(x, Routing(routing.weights, routing.experts + 8), up, down, "silu")


# transformers' routers and experts, built from their config classes, fed the same weights.


def _sorted(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Order each token's picks by expert id (transformers' NemotronH takes its top-k unsorted)."""
    order = experts.argsort(-1)
    return weights.gather(1, order), experts.gather(1, order)


def _compare_with_transformers(
    router_cls, experts_cls, config, route_kwargs: dict, activation: str, gated: bool
) -> None:
    torch.manual_seed(0)
    hidden = config.hidden_size
    x = torch.randn(19, hidden)
    with torch.inference_mode():
        router = router_cls(config)
        router.weight.copy_(torch.randn_like(router.weight))
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.rand_like(bias) * 0.2)
        _, hf_weights, hf_experts = router(x)
        logits = F.linear(x, router.weight)
        routing = moe_route(logits, bias=bias, **route_kwargs)
        got_w, got_e = _sorted(routing.weights, routing.experts)
        want_w, want_e = _sorted(hf_weights.float(), hf_experts)
        assert torch.equal(got_e, want_e)
        torch.testing.assert_close(got_w, want_w, **TOL)

        experts = experts_cls(config)
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        up = experts.gate_up_proj if gated else experts.up_proj
        want = experts(x, hf_experts, hf_weights)
        got = moe_experts(x, routing, up, experts.down_proj, activation, gated)
        torch.testing.assert_close(got, want, **TOL)


def test_matches_transformers_qwen3_next() -> None:
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=10, norm_topk_prob=True
    )
    route = {"top_k": 3, "scoring": "softmax", "norm_topk_prob": True}
    _compare_with_transformers(mod.Qwen3NextTopKRouter, mod.Qwen3NextExperts, config, route, "silu", True)


def test_matches_transformers_jamba() -> None:
    mod = pytest.importorskip("transformers.models.jamba.modeling_jamba")
    from transformers import JambaConfig

    config = JambaConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2, intermediate_size=10)
    route = {"top_k": 2, "scoring": "softmax", "norm_topk_prob": False}
    _compare_with_transformers(mod.JambaTopKRouter, mod.JambaExperts, config, route, "silu", True)


def test_matches_transformers_granitemoehybrid() -> None:
    mod = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")
    from transformers import GraniteMoeHybridConfig

    config = GraniteMoeHybridConfig(
        hidden_size=16,
        num_local_experts=8,
        num_experts_per_tok=3,
        intermediate_size=10,
        mamba_n_heads=8,
        mamba_d_head=4,
    )
    route = {"top_k": 3, "scoring": "softmax", "norm_topk_prob": True}
    _compare_with_transformers(mod.GraniteMoeHybridTopKRouter, mod.GraniteMoeHybridExperts, config, route, "silu", True)


def test_matches_transformers_nemotron_h() -> None:
    mod = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    from transformers import NemotronHConfig

    config = NemotronHConfig(
        hidden_size=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=10,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    route = {
        "top_k": 4,
        "scoring": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "n_group": 4,
        "topk_group": 2,
    }
    _compare_with_transformers(mod.NemotronHTopkRouter, mod.NemotronHExperts, config, route, "relu2", False)
