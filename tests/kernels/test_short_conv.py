"""LFM2's short convolution is `causal_conv1d` / `causal_conv1d_update` with no activation.

Lfm2ShortConv: B, C, x = in_proj(h) split in thirds (B first); out = out_proj(C * conv(B * x)), the
conv depthwise causal of width L_cache with an optional bias and no activation. transformers
caches the last L_cache conv inputs; the last L_cache - 1 of them (what our ops keep) are all that
the next step reads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from himamba.kernels import causal_conv1d, causal_conv1d_update


def naive_short_conv(bx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The specification in float64: out[t] = bias + sum_k w[k] * bx[t - (K-1) + k], zeros before t = 0."""
    width = weight.shape[1]
    padded = F.pad(bx.double(), (width - 1, 0))
    out = torch.stack([(padded[:, :, t : t + width] * weight.double()).sum(-1) for t in range(bx.shape[-1])], dim=-1)
    return out if bias is None else out + bias.double()[:, None]


@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("length", [1, 2, 9])
def test_gated_short_conv_prefill_and_decode_match_spec(use_bias: bool, length: int) -> None:
    g = torch.Generator().manual_seed(length)
    channels, width, steps = 6, 3, 4
    b, c, x = (torch.randn(2, channels, length + steps, generator=g) for _ in range(3))
    weight = torch.randn(channels, width, generator=g)
    bias = torch.randn(channels, generator=g) if use_bias else None
    want = c.double() * naive_short_conv(b * x, weight, bias)
    prefill = causal_conv1d(b[:, :, :length] * x[:, :, :length], weight, bias, None, activation=None)
    state = prefill.final_state.clone()
    outs = [c[:, :, :length] * prefill.out]
    for t in range(length, length + steps):
        outs.append(
            c[:, :, t : t + 1] * causal_conv1d_update(b[:, :, t] * x[:, :, t], state, weight, bias, None)[:, :, None]
        )
    torch.testing.assert_close(torch.cat(outs, dim=-1).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompt_len", [1, 2, 7])
def test_matches_transformers_lfm2_layer_with_cache(prompt_len: int) -> None:
    lfm2 = pytest.importorskip("transformers.models.lfm2.modeling_lfm2")
    from transformers import DynamicCache, Lfm2Config

    hidden, width, steps = 12, 3, 3
    config = Lfm2Config(
        hidden_size=hidden,
        num_hidden_layers=2,
        layer_types=["conv", "full_attention"],
        conv_L_cache=width,
        conv_bias=True,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=24,
        vocab_size=32,
    )
    torch.manual_seed(prompt_len)
    layer = lfm2.Lfm2ShortConv(config, 0)
    cache = DynamicCache(config=config)
    h = torch.randn(2, prompt_len + steps, hidden)
    weight, bias = layer.conv.weight[:, 0], layer.conv.bias  # HF's Conv1d weight is [D, 1, K]

    def ours(tokens: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b, c, x = layer.in_proj(tokens).transpose(1, 2).chunk(3, dim=1)  # each [Bt, D, L]
        if state is None:
            out, state = causal_conv1d(b * x, weight, bias, None, activation=None)
        else:
            out = causal_conv1d_update((b * x)[:, :, 0], state, weight, bias, None)[:, :, None]
        return layer.out_proj((c * out).transpose(1, 2)), state

    with torch.inference_mode():
        want = layer(h[:, :prompt_len], past_key_values=cache)
        got, state = ours(h[:, :prompt_len], None)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for t in range(prompt_len, prompt_len + steps):
            want = layer(h[:, t : t + 1], past_key_values=cache)
            got, state = ours(h[:, t : t + 1], state)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            # transformers keeps L_cache inputs; ours are its last L_cache - 1.
            hf_state = cache.layers[0].conv_states[0]
            assert hf_state.shape[-1] == width and state.shape[-1] == width - 1
            torch.testing.assert_close(state, hf_state[:, :, 1:], rtol=0, atol=0)
