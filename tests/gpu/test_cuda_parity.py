"""Greedy parity with transformers on the check's device, for every family transformers carries:
our worker path (paged KV with shuffled pages and slots, four prompts of 1/7/64/300 tokens prefilled
and decoded as one batch) against transformers' `generate` on the same device.

float32: the same 16 tokens, except after a near-tie (the reference's top-2 margin under 1e-3).
bfloat16: the same tokens up to the first step where the reference's top-2 margin is under 0.1 (bf16
carries ~3 significant digits, and the two implementations round in different places); how many
agree is written to the check's figures (HIMAMBA_CHECK_FIGURES, one JSON object per line)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from himamba.services.worker.loader import load_model
from tests.e2e.prompts import random_tokens
from tests.gpu.conftest import tiny
from tests.worker.harness import Harness
from tests.worker.hf_reference import HF_VOCAB, TINY_CONFIGS, save_tiny

FAMILIES = ["NemotronH"] if tiny() else list(TINY_CONFIGS)
LENGTHS = [1, 7, 24] if tiny() else [1, 7, 64, 300]
NEW_TOKENS = 6 if tiny() else 16
NEAR_TIE = {torch.float32: 1e-3, torch.bfloat16: 0.1}


def _reference(model_dir, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    if hasattr(config, "use_mamba_kernels"):
        # Jamba refuses CUDA with mamba_ssm's kernels asked for and not installed; the torch path is the reference.
        config.use_mamba_kernels = False
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def _reference_greedy(model, ids: list[int], device: torch.device) -> tuple[list[int], torch.Tensor]:
    input_ids = torch.tensor([ids], device=device)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(ids) :].tolist(), torch.stack([s[0] for s in out.logits]).float().cpu()


def _agreeing(got: list[int], want: list[int], logits: torch.Tensor, near_tie: float) -> tuple[int, bool]:
    """How many leading tokens agree, and whether the first disagreement follows a near-tie."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            top2 = logits[i].topk(2).values
            return i, bool(top2[0] - top2[1] < near_tie)
    return len(want), True


def _record(figures: dict) -> None:
    path = os.environ.get("HIMAMBA_CHECK_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(figures) + "\n")


def _overrides(family: str) -> dict:
    """Config changes that keep the reference honest on older transformers (the GPU image has 5.17):
    before its gated RMSNorm took `group_size`, transformers' Mamba2 normalised over all heads at
    once instead of per group, which differs from Mamba2 (and from us) whenever n_groups > 1."""
    if family == "Mamba2":
        import inspect

        from transformers.models.mamba2 import modeling_mamba2

        if "group_size" not in inspect.signature(modeling_mamba2.MambaRMSNormGated.__init__).parameters:
            return {"n_groups": 1}
    return {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers(device, family, dtype, tmp_path):
    save_tiny(family, tmp_path, **_overrides(family))
    ref = _reference(tmp_path, device, dtype)
    ours = load_model(tmp_path, device, dtype, pack_cpu_weights=device.type == "cpu")
    prompts = [random_tokens(n, seed=i, vocab=HF_VOCAB) for i, n in enumerate(LENGTHS)]
    with torch.inference_mode():
        got = Harness(ours, device=device, num_pages=128).generate_greedy(prompts, NEW_TOKENS)
    agree, failures = _compare(ref, prompts, got, device, dtype)
    figures = {"family": family, "dtype": str(dtype), "agreeing_tokens": agree, "of": NEW_TOKENS}
    if failures and device.type != "cpu":
        # Which side left the reference: transformers' own CPU path says whether its device path
        # (fallback kernels, other code) is the one that disagrees.
        cpu_ref = _reference(tmp_path, torch.device("cpu"), dtype)
        cpu_agree, cpu_failures = _compare(cpu_ref, prompts, got, torch.device("cpu"), dtype)
        figures.update(agreeing_with_transformers_cpu=cpu_agree)
        if not cpu_failures:
            figures["reference"] = "transformers on cpu: its device path disagrees with its own cpu path"
            failures = []
    _record(figures)
    assert not failures, failures


def _compare(ref, prompts, got, device, dtype) -> tuple[list[int], list[str]]:
    agree, failures = [], []
    for prompt, tokens in zip(prompts, got, strict=True):
        want, logits = _reference_greedy(ref, prompt, device)
        n, after_tie = _agreeing(tokens, want, logits, NEAR_TIE[dtype])
        agree.append(n)
        if not after_tie:
            failures.append(f"prompt of {len(prompt)}: token {n} differs ({tokens[n]} vs {want[n]}) with no near-tie")
    return agree, failures
