"""worker/logprobs.py: which logit rows a forward returns, and the prompt logprobs assembled from
them over prefill chunks (a chunk's last row predicts the next chunk's first token), in batches
that mix sequences that ask with ones that do not."""

from __future__ import annotations

import pytest
import torch

from himamba.common.messages import SeqPlan
from himamba.common.types import SamplingParams
from himamba.services.worker.logprobs import plan_logit_rows, prompt_logprobs, sampled_logprobs
from himamba.services.worker.page_tables import SeqState

V = 50


def _state(num_prompt: int, prompt_logprobs: int | None) -> SeqState:
    sampling = SamplingParams(prompt_logprobs=prompt_logprobs)
    return SeqState(0, sampling, None, num_prompt)


class _Seq:
    """A sequence's whole-context logits (what the model would give at every position)."""

    def __init__(self, num_prompt: int, k: int | None, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, V, (num_prompt,), generator=gen)
        self.logits = torch.randn(num_prompt, V, generator=gen) * 3
        self.state = _state(num_prompt, k)
        self.done = 0
        self.got: dict[int, float] = {}  # position -> logprob
        self.top: dict[int, list[int]] = {}


def _run(seqs: list[_Seq], chunks: list[list[int]]) -> None:
    """Prefill steps: chunks[step][i] new tokens for sequence i (0: not in this step)."""
    for sizes in chunks:
        members = [(s, n) for s, n in zip(seqs, sizes, strict=True) if n]
        plans = [SeqPlan(f"r{i}", s.done, n, i) for i, (s, n) in enumerate(members)]
        states = [s.state for s, _ in members]
        plan = plan_logit_rows("prefill", plans, states)
        input_ids = torch.cat([s.ids[s.done : s.done + n] for s, n in members])
        every_row = torch.cat([s.logits[s.done : s.done + n] for s, n in members])
        if plan is None:
            rows = torch.tensor([sum(n for _, n in members[: i + 1]) - 1 for i in range(len(members))])
            logits = every_row[rows]
        else:
            logits = every_row[plan.rows]
            # The last rows are each sequence's last new token, where it samples.
            last = logits[plan.last]
            ends = torch.tensor([sum(n for _, n in members[: i + 1]) - 1 for i in range(len(members))])
            assert torch.equal(last, every_row[ends])
            for i, span in prompt_logprobs(logits, plan, input_ids, states).items():
                s = members[i][0]
                for j, entry in enumerate(span.entries):
                    s.got[span.start + j] = entry.logprob
                    s.top[span.start + j] = entry.top_ids
        for s, n in members:
            s.done += n


@pytest.mark.parametrize("chunking", ["whole", "chunks", "ragged"])
def test_prompt_logprobs_over_chunks_in_mixed_batches(chunking: str):
    asks = _Seq(23, 3, seed=1)
    plain = _Seq(9, None, seed=2)
    other = _Seq(14, 0, seed=3)
    seqs = [asks, plain, other]
    if chunking == "whole":
        steps = [[23, 9, 14]]
    elif chunking == "chunks":
        steps = [[8, 9, 0], [8, 0, 7], [7, 0, 7]]
    else:  # one-token chunks and a chunk that ends exactly before the last prompt token
        steps = [[1, 4, 13], [1, 5, 1], [20, 0, 0], [1, 0, 0]]
    _run(seqs, steps)
    for s in (asks, other):
        want = torch.log_softmax(s.logits, dim=-1)
        n = len(s.ids)
        assert sorted(s.got) == list(range(1, n))  # every prompt token but the first, once
        for p in range(1, n):
            assert s.got[p] == pytest.approx(want[p - 1, s.ids[p]].item(), abs=1e-6)
            k = s.state.sampling.prompt_logprobs or 0
            assert len(s.top[p]) == k
            if k:
                assert want[p - 1, s.top[p]].tolist() == pytest.approx(torch.topk(want[p - 1], k).values.tolist())
        assert s.state.pending_prompt_row is None  # nothing left waiting after the last chunk
    assert plain.got == {}


def test_no_prompt_logprobs_no_extra_rows():
    states = [_state(10, None), _state(5, None)]
    assert plan_logit_rows("prefill", [SeqPlan("a", 0, 10, 0), SeqPlan("b", 0, 5, 1)], states) is None
    states = [_state(10, 2)]
    assert plan_logit_rows("decode", [SeqPlan("a", 10, 1, 0)], states) is None


def test_sampled_logprobs_only_for_rows_that_ask():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(logprobs=True, top_logprobs=4), SamplingParams(logprobs=True)]
    tokens = [1, 2, 3]
    got = sampled_logprobs(logits, params, tokens, {})
    want = torch.log_softmax(logits, dim=-1)
    assert set(got) == {1, 2}
    assert got[1].logprob == pytest.approx(want[1, 2].item()) and got[2].logprob == pytest.approx(want[2, 3].item())
    assert got[1].top_ids == torch.topk(want[1], 4).indices.tolist() and got[2].top_ids == []
    assert got[1].rank == int((want[1] > want[1, 2]).sum()) + 1
    assert sampled_logprobs(logits, params, tokens, {1: "failed"}).keys() == {2}
