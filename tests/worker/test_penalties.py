"""Penalties kept per sequence in the worker (fed the tokens as they are computed) equal the
penalties over the whole context: transformers' repetition penalty (prompt and output) and
OpenAI's frequency/presence penalties (output only)."""

from __future__ import annotations

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from himamba.common.types import SamplingParams
from himamba.services.worker.penalties import PenaltyState, penalise_rows

V = 50


def test_fed_in_chunks_equals_the_whole_context():
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (23,), generator=gen).tolist()
    output = torch.randint(0, V, (9,), generator=gen).tolist()
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25)
    state = PenaltyState(V, num_prompt=len(prompt), device=torch.device("cpu"))
    context = prompt + output
    # As the worker sees it: the cached history at reset, then a prefill chunk, then decode steps.
    state.feed(context[:10])
    state.feed(context[10:25])
    for t in context[25:]:
        state.feed([t])
    logits = torch.randn(V, generator=gen)
    got = state.apply(logits, p)

    want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([context]), logits[None].clone())[0]
    counts = torch.bincount(torch.tensor(output), minlength=V).float()
    want = want - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    torch.testing.assert_close(got, want)
    assert state.length == len(context)


def test_no_penalty_leaves_the_logits_and_is_not_kept():
    assert not SamplingParams().penalised and SamplingParams(presence_penalty=0.1).penalised
    state = PenaltyState(V, num_prompt=3, device=torch.device("cpu"))
    state.feed([1, 2, 3, 4])
    logits = torch.randn(V)
    torch.testing.assert_close(state.apply(logits, SamplingParams()), logits)


def test_a_batch_is_penalised_as_each_row_alone_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(frequency_penalty=-0.3),
        SamplingParams(presence_penalty=1.5),
    ]
    states: list[PenaltyState | None] = []
    for i, p in enumerate(params):
        if p.penalised:
            state = PenaltyState(V, num_prompt=4, device=torch.device("cpu"))
            state.feed(torch.randint(0, V, (10 + i,), generator=gen).tolist())
            states.append(state)
        else:
            states.append(None)
    logits = torch.randn(len(params), V, generator=gen) * 3
    before = logits.clone()
    got = penalise_rows(logits, states, params)
    for i, (state, p) in enumerate(zip(states, params, strict=True)):
        want = logits[i] if state is None else state.apply(logits[i], p)
        assert torch.equal(got[i], want), i
    assert torch.equal(logits, before)  # the model's logits are left as they were (logprobs read them)
    every = penalise_rows(logits[[0, 2]], [states[0], states[2]], [params[0], params[2]])
    assert torch.equal(every, got[[0, 2]])
