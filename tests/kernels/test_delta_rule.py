"""chunk_gated_delta_rule / recurrent_gated_delta_rule_update against a per-token float64 specification
and against transformers' Qwen3-Next torch functions."""

from __future__ import annotations

import pytest
import torch

from himamba.kernels import DeltaResult, chunk_gated_delta_rule, recurrent_gated_delta_rule_update

TOL = {"rtol": 1e-5, "atol": 1e-5}


def naive_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    use_qk_l2norm: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification, in float64, one token at a time (value head h reads q/k head h // (Hv/Hk)):
    S = exp(g) S;  S += k ⊗ beta (v - S^T k);  o = S^T (scale * q)."""
    batch, length, k_heads, k_dim = q.shape
    v_heads, v_dim = v.shape[2:]
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (k_dim**-0.5 if scale is None else scale)
    q, k = (t.repeat_interleave(v_heads // k_heads, dim=2) for t in (q, k))
    s = torch.zeros(batch, v_heads, k_dim, v_dim, dtype=torch.float64) if state is None else state.double().clone()
    out = torch.zeros(batch, length, v_heads, v_dim, dtype=torch.float64)
    for t in range(length):
        s = s * torch.exp(g[:, t])[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", s, k[:, t])
        write = beta[:, t, :, None] * (v[:, t] - predicted)
        s = s + torch.einsum("bhk,bhv->bhkv", k[:, t], write)
        out[:, t] = torch.einsum("bhkv,bhk->bhv", s, q[:, t])
    return out, s


def make(
    batch: int, length: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, seed: int, decay: float = 2.0
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(batch, length, k_heads, k_dim, generator=gen),
        "k": torch.randn(batch, length, k_heads, k_dim, generator=gen),
        "v": torch.randn(batch, length, v_heads, v_dim, generator=gen),
        "g": -decay * torch.rand(batch, length, v_heads, generator=gen),
        "beta": torch.rand(batch, length, v_heads, generator=gen),
        "state": torch.randn(batch, v_heads, k_dim, v_dim, generator=gen),
    }


SHAPES = [(1, 1, 1, 4, 4), (2, 2, 4, 8, 6), (2, 3, 3, 5, 7)]  # (Bt, Hk, Hv, Dk, Dv)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("length,chunk", [(1, 16), (7, 16), (33, 16), (130, 64), (130, 16)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_spec(shape: tuple[int, ...], length: int, chunk: int, with_state: bool) -> None:
    batch, k_heads, v_heads, k_dim, v_dim = shape
    t = make(batch, length, k_heads, v_heads, k_dim, v_dim, seed=length + chunk + v_heads)
    init = t["state"] if with_state else None
    result = chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], chunk, init)
    want_out, want_state = naive_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], init, True, None)
    assert isinstance(result, DeltaResult)
    assert result.out.shape == (batch, length, v_heads, v_dim) and result.out.dtype == torch.float32
    assert result.final_state.shape == (batch, v_heads, k_dim, v_dim) and result.final_state.dtype == torch.float32
    torch.testing.assert_close(result.out.double(), want_out, **TOL)
    torch.testing.assert_close(result.final_state.double(), want_state, **TOL)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_without_l2norm_and_with_explicit_scale(scale: float | None) -> None:
    t = make(2, 40, 2, 4, 8, 6, seed=4)
    k = t["k"] / 8**0.5  # keeps |k|^2 near 1 so the un-normalised recurrence stays bounded
    result = chunk_gated_delta_rule(t["q"], k, t["v"], t["g"], t["beta"], 16, t["state"], False, scale)
    want_out, want_state = naive_delta_rule(t["q"], k, t["v"], t["g"], t["beta"], t["state"], False, scale)
    torch.testing.assert_close(result.out.double(), want_out, **TOL)
    torch.testing.assert_close(result.final_state.double(), want_state, **TOL)
    state = t["state"].clone()
    out = recurrent_gated_delta_rule_update(
        t["q"][:, 0], k[:, 0], t["v"][:, 0], t["g"][:, 0], t["beta"][:, 0], state, False, scale
    )
    want_out, want_state = naive_delta_rule(
        t["q"][:, :1], k[:, :1], t["v"][:, :1], t["g"][:, :1], t["beta"][:, :1], t["state"], False, scale
    )
    torch.testing.assert_close(out.double(), want_out[:, 0], **TOL)
    torch.testing.assert_close(state.double(), want_state, **TOL)


def test_strong_decay_stays_exact() -> None:
    """Log decays of -20..-40 per token: the cumulative decay of a 64-token chunk is about -2000,
    far beyond float32's exp range, yet the recent tokens must still be read exactly."""
    t = make(1, 100, 2, 2, 8, 8, seed=5, decay=20.0)
    g = t["g"] - 20.0
    result = chunk_gated_delta_rule(t["q"], t["k"], t["v"], g, t["beta"], 64, t["state"])
    want_out, want_state = naive_delta_rule(t["q"], t["k"], t["v"], g, t["beta"], t["state"], True, None)
    torch.testing.assert_close(result.out.double(), want_out, **TOL)
    torch.testing.assert_close(result.final_state.double(), want_state, **TOL)


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_chunked_equals_recurrent_steps(shape: tuple[int, ...]) -> None:
    batch, k_heads, v_heads, k_dim, v_dim = shape
    t = make(batch, 45, k_heads, v_heads, k_dim, v_dim, seed=6)
    whole = chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], 16, t["state"])
    state = t["state"].clone()
    ptr = state.data_ptr()
    with torch.inference_mode():
        outs = [
            recurrent_gated_delta_rule_update(
                t["q"][:, i], t["k"][:, i], t["v"][:, i], t["g"][:, i], t["beta"][:, i], state
            )
            for i in range(45)
        ]
    assert state.data_ptr() == ptr
    torch.testing.assert_close(torch.stack(outs, dim=1), whole.out, **TOL)
    torch.testing.assert_close(state, whole.final_state, **TOL)


@pytest.mark.parametrize("split", [1, 16, 30, 63])
def test_split_equals_whole(split: int) -> None:
    t = make(2, 64, 2, 4, 8, 6, seed=split)
    args = [t[n] for n in ("q", "k", "v", "g", "beta")]
    whole = chunk_gated_delta_rule(*args, 16, t["state"])
    first = chunk_gated_delta_rule(*(a[:, :split] for a in args), 16, t["state"])
    second = chunk_gated_delta_rule(*(a[:, split:] for a in args), 16, first.final_state)
    torch.testing.assert_close(torch.cat([first.out, second.out], dim=1), whole.out, **TOL)
    torch.testing.assert_close(second.final_state, whole.final_state, **TOL)


def test_prefill_then_decode_equals_longer_prefill() -> None:
    t = make(3, 20, 1, 2, 6, 4, seed=8)
    args = [t[n] for n in ("q", "k", "v", "g", "beta")]
    whole = chunk_gated_delta_rule(*args, 8)
    state = chunk_gated_delta_rule(*(a[:, :15] for a in args), 8).final_state.clone()
    outs = [recurrent_gated_delta_rule_update(*(a[:, i] for a in args), state) for i in range(15, 20)]
    torch.testing.assert_close(torch.stack(outs, dim=1), whole.out[:, 15:], **TOL)
    torch.testing.assert_close(state, whole.final_state, **TOL)


def test_initial_state_is_not_modified_and_empty_segment_keeps_it() -> None:
    t = make(2, 10, 2, 2, 4, 4, seed=9)
    init = t["state"].clone()
    chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], 4, init)
    torch.testing.assert_close(init, t["state"], rtol=0, atol=0)
    empty = chunk_gated_delta_rule(*(t[n][:, :0] for n in ("q", "k", "v", "g", "beta")), 4, init)
    assert empty.out.shape == (2, 0, 2, 4)
    torch.testing.assert_close(empty.final_state, init, rtol=0, atol=0)


def test_bfloat16_inputs_and_state() -> None:
    t = make(2, 24, 2, 4, 8, 8, seed=10)
    bf = {n: x.bfloat16() for n, x in t.items()}
    result = chunk_gated_delta_rule(bf["q"], bf["k"], bf["v"], bf["g"], bf["beta"], 16, bf["state"])
    assert result.out.dtype == torch.bfloat16 and result.final_state.dtype == torch.bfloat16
    want_out, _ = naive_delta_rule(bf["q"], bf["k"], bf["v"], bf["g"], bf["beta"], bf["state"], True, None)
    torch.testing.assert_close(result.out.double(), want_out, rtol=5e-2, atol=5e-2)
    state = bf["state"].clone()
    out = recurrent_gated_delta_rule_update(
        bf["q"][:, 0], bf["k"][:, 0], bf["v"][:, 0], bf["g"][:, 0], bf["beta"][:, 0], state
    )
    assert out.dtype == torch.bfloat16 and state.dtype == torch.bfloat16


def test_bad_input_raises_value_error() -> None:
    t = make(2, 5, 2, 4, 4, 4, seed=11)
    q, k, v, g, beta, state = (t[n] for n in ("q", "k", "v", "g", "beta", "state"))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(q, k, v, g, beta, 0)
    with pytest.raises(ValueError, match="k must"):
        chunk_gated_delta_rule(q, k[:, :, :1], v, g, beta)
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match="beta"):
        chunk_gated_delta_rule(q, k, v, g, beta[:, :, :2])
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q, k, v, g, beta, 4, state[:, :2])
    with pytest.raises(ValueError, match="q must"):
        recurrent_gated_delta_rule_update(q, k, v, g, beta, state)
    with pytest.raises(ValueError, match="state must"):
        recurrent_gated_delta_rule_update(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state[:1])


def test_matches_transformers_qwen3_next() -> None:
    qwen = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    t = make(2, 75, 2, 4, 16, 8, seed=12)
    args = [t[n] for n in ("q", "k", "v", "g", "beta")]
    for chunk in (16, 64):
        want_out, want_state = qwen.torch_chunk_gated_delta_rule(
            *args,
            chunk_size=chunk,
            initial_state=t["state"].clone(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        got = chunk_gated_delta_rule(*args, chunk, t["state"])
        torch.testing.assert_close(got.out, want_out, **TOL)
        torch.testing.assert_close(got.final_state, want_state, **TOL)
    # The decode call as Qwen3NextGatedDeltaNet makes it: one token, the cached state.
    step = [a[:, :1] for a in args]
    want_out, want_state = qwen.torch_recurrent_gated_delta_rule(
        *step, initial_state=t["state"].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    state = t["state"].clone()
    out = recurrent_gated_delta_rule_update(*(a[:, 0] for a in args), state)
    torch.testing.assert_close(out, want_out[:, 0], **TOL)
    torch.testing.assert_close(state, want_state, **TOL)
