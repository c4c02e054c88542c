"""Every family with a config that differs from transformers' defaults in every dimension we can vary
(tests/worker/hf_reference.VARIED_CONFIGS), saved by transformers' `save_pretrained`: prefill logits and
greedy tokens equal transformers', batched generation equals one sequence at a time, and a state
captured mid-prefill equals a prefill of that prefix. A config field our loader ignored would change
a weight's shape (refused at load) or the logits. Which declared fields are left at their default,
and why none of them matters, is listed here (NOT_VARIED), and checked against the config class."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from tests.worker import family_checks as checks
from tests.worker.harness import Harness
from tests.worker.hf_reference import (
    _SPECIAL_IDS,
    HF_VOCAB,
    TINY_CONFIGS,
    VARIED_CONFIGS,
    greedy_with_logits,
    load_reference,
    save_varied,
)

FAMILIES = tuple(VARIED_CONFIGS)
# Greedy tokens are compared up to the first step whose top-2 logit gap (ours or transformers') is
# below this: random weights make near-ties, and different GEMM kernels may flip them.
NEAR_TIE = 1e-3
# Overrides left at transformers' default on purpose: Zamba2's attention adapters need as many KV heads
# as query heads (the tiny config has adapters; grouped KV is the dimension varied here).
AT_DEFAULT = {("Zamba2", "use_shared_attention_adapter")}


# The fields each family's config class declares that the varied checkpoint leaves at transformers'
# default, and why that is no gap: none of them changes a shape or the numerics of a loaded
# checkpoint. Every other declared field differs from its default in the varied config (checked below).
_INIT = "initialisation only: the weights come from the checkpoint"
_TRAIN = "training only"
_CACHE = "transformers' own cache or output switch"
_KERNEL = "which of transformers' kernels computes the same thing"
_TOKENS = "a token id: no shape or numerics (the server's stop tokens are tested elsewhere)"
_NO_MAX_POS = "no varied RoPE reads it (yarn reads it only without original_max_position_embeddings, given here)"
_COMMON = {
    "initializer_range": _INIT,
    "use_cache": _CACHE,
    "num_logits_to_keep": _CACHE,
    "pad_token_id": _TOKENS,
    "bos_token_id": _TOKENS,
    "attention_dropout": _TRAIN,
    "hidden_dropout": _TRAIN,
    "output_router_logits": _TRAIN,
    "router_aux_loss_coef": _TRAIN,
    "z_loss_coefficient": _TRAIN,
    "max_position_embeddings": _NO_MAX_POS,
    "time_step_max": _INIT,
    "time_step_floor": _INIT,
    "rescale_prenorm_residual": _INIT,
    "use_mamba_kernels": _KERNEL,
}
NOT_VARIED: dict[str, dict[str, str]] = {
    "NemotronH": {
        **_COMMON,
        "attention_bias": "not read by transformers' NemotronH (use_bias and mlp_bias are, both varied)",
        "sliding_window": "not read by transformers' NemotronH",
        "expand": "not read: the mixer is mamba_num_heads x mamba_head_dim wide (both varied)",
        "time_step_limit": "not read: NemotronH clamps dt at time_step_min (varied)",
        "mamba_proj_bias": "not read (use_bias is, varied)",
        "mamba_ssm_cache_dtype": _CACHE,
        "n_shared_experts": "not read (moe_shared_expert_intermediate_size is, varied)",
        "moe_shared_expert_overlap": "not read by transformers' NemotronH",
        "num_nextn_predict_layers": "multi-token prediction layers: not part of the causal LM",
        "mtp_layers_block_type": "multi-token prediction layers: not part of the causal LM",
        "residual_in_fp32": "not read by transformers' NemotronH",
    },
    "GraniteMoeHybrid": dict(_COMMON),
    "Bamba": dict(_COMMON),
    "FalconH1": {**_COMMON, "mamba_expand": "not read when mamba_d_ssm is set (varied)"},
    "Qwen3Next": dict(_COMMON),
    "Mamba2": {**_COMMON, "time_step_min": _INIT + " (time_step_limit, varied, is the clamp)"},
    "Zamba2": {
        **_COMMON,
        "use_mem_eff_path": _KERNEL,
        "use_long_context": "only sets max_position_embeddings (see there)",
        "use_shared_attention_adapter": "left on (the tiny config's adapters) so that grouped KV can be varied",
    },
    "Lfm2": {
        **_COMMON,
        "block_auto_adjust_ff_dim": "left on so that block_multiple_of and block_ffn_dim_multiplier (varied) act;"
        " off is tested in test_lfm2_parity.py",
    },
    "Jamba": {**_COMMON, "use_mambapy": _KERNEL, "use_associative_scan": _KERNEL},
}


@pytest.mark.parametrize("architecture", FAMILIES)
def test_every_declared_field_that_changes_shapes_or_numerics_is_varied(architecture: str) -> None:
    """Every field the family's config class declares differs from transformers' default in the
    varied checkpoint (after the config's own derivations), unless NOT_VARIED says why it need not."""
    import transformers

    cls = getattr(transformers, f"{architecture}Config")
    declared = set(inspect.get_annotations(cls))
    default = cls().to_dict()
    config = {"vocab_size": HF_VOCAB, **TINY_CONFIGS[architecture], **_SPECIAL_IDS, **VARIED_CONFIGS[architecture]}
    varied = cls(**config).to_dict()
    at_default = {name for name in declared if varied.get(name) == default.get(name)}
    listed = {name for name in NOT_VARIED[architecture] if name in declared}
    assert at_default <= listed, f"{architecture}: left at the default without a reason: {sorted(at_default - listed)}"


@pytest.fixture(scope="module", params=FAMILIES)
def varied(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Any]:
    from himamba.services.worker.loader import load_model

    path = save_varied(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, load_model(path), load_reference(path)


def test_the_nine_families_are_varied() -> None:
    assert set(FAMILIES) == set(TINY_CONFIGS) and len(FAMILIES) == 9


@pytest.mark.parametrize("architecture", FAMILIES)
def test_every_override_differs_from_transformers_default(architecture: str) -> None:
    import transformers

    default = getattr(transformers, f"{architecture}Config")().to_dict()
    for key, value in VARIED_CONFIGS[architecture].items():
        # head_dim is read by every attention layer (`getattr(config, "head_dim", hidden // heads)`)
        # even where the config class does not declare it.
        assert key in default or key == "head_dim", f"{architecture}: {key} is not a config field"
        if key not in default or (architecture, key) in AT_DEFAULT:
            continue
        if isinstance(value, dict):  # rope_parameters: every entry differs from the default's
            assert all(default[key].get(k) != v for k, v in value.items() if k != "rope_type"), key
        else:
            assert default[key] != value, f"{architecture}: {key}={value!r} is transformers' default"


def test_prefill_logits_match_transformers(varied: tuple[str, Any, Any]) -> None:
    _, ours, ref = varied
    checks.assert_prefill_parity(ours, ref, (1, 7, 64, 200))


def _top2_gap(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def test_greedy_tokens_match_transformers_up_to_the_first_near_tie(varied: tuple[str, Any, Any]) -> None:
    name, ours, ref = varied
    lengths, new_tokens = (1, 9, 70), 24
    prompts = [checks.prompt(ours.vocab_size, n, seed=200 + n) for n in lengths]
    harness = Harness(ours)
    seqs = [harness.new_sequence() for _ in prompts]
    logits = harness.prefill(seqs, prompts)
    ours_logits, ours_tokens = [logits], [logits.argmax(-1).tolist()]
    for _ in range(new_tokens - 1):
        logits = harness.decode(seqs, ours_tokens[-1])
        ours_logits.append(logits)
        ours_tokens.append(logits.argmax(-1).tolist())
    compared = 0
    for i, p in enumerate(prompts):
        expected, ref_logits = greedy_with_logits(ref, p, new_tokens)
        for step in range(new_tokens):
            mine = ours_logits[step][i]
            if min(_top2_gap(mine), _top2_gap(ref_logits[step])) < NEAR_TIE:
                break  # a near-tie: either token is right, and what follows may differ
            assert ours_tokens[step][i] == expected[step], f"{name}: prompt {len(p)} step {step}"
            assert (mine - ref_logits[step]).abs().max().item() < 1e-3, f"{name}: prompt {len(p)} step {step}"
            compared += 1
    assert compared >= new_tokens, f"{name}: only {compared} greedy steps before near-ties"


def test_batch_equals_one_by_one(varied: tuple[str, Any, Any]) -> None:
    checks.assert_batch_equals_one_by_one(varied[1])


def test_captures_equal_prefix_prefills(varied: tuple[str, Any, Any]) -> None:
    checks.assert_captures_equal_prefix_prefills(varied[1])
