"""Decode steps do not clamp dt to `time_step_limit`: transformers (and mamba_ssm, vLLM) apply the
limit in the chunked scan only, so a model whose softplus(dt + dt_bias) falls below time_step_min
(real checkpoints do, for some heads) must decode exactly as transformers does."""

from __future__ import annotations

import torch

from himamba.services.worker.loader import load_model
from tests.worker.harness import Harness
from tests.worker.hf_reference import load_reference, save_nemotron_h

TIME_STEP_MIN = 0.1
AMPLIFY = 100.0  # the Mamba mixers' share of the logits, which is tiny in a random model
DT_BIAS = -4.0  # softplus(-4) ~ 0.018: below time_step_min, so a clamp would change every decode step


def test_decode_logits_match_transformers_below_time_step_min(tmp_path):
    path = save_nemotron_h(tmp_path / "hf", seed=4, time_step_min=TIME_STEP_MIN)
    ref = load_reference(path)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("dt_bias"):
                p.fill_(DT_BIAS)
            elif name.endswith("mixer.out_proj.weight") and p.shape[0] == ref.config.hidden_size:
                p.mul_(AMPLIFY)
    ref.save_pretrained(path)
    ours = load_model(path)
    ref = load_reference(path)
    assert ref.config.time_step_min > torch.nn.functional.softplus(torch.tensor(DT_BIAS)).item()

    ids = torch.randint(1, ours.vocab_size, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    steps = 6
    out = ref.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=steps,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[0, len(ids) :].tolist()
    harness = Harness(ours, num_pages=16)
    seq = harness.new_sequence()
    logits = harness.prefill([seq], [ids])
    errors = [(logits[0] - out.logits[0][0]).abs().max().item()]
    for i in range(1, steps):  # transformers' step i ran the decode path on its token i-1
        logits = harness.decode([seq], [new[i - 1]])
        errors.append((logits[0] - out.logits[i][0]).abs().max().item())
    # Float32 agreement is ~1e-7 here; clamping dt in decode shows as ~2e-5 from the first step.
    assert max(errors) < 2e-6, f"max logit error per step {errors}"
