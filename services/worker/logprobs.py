"""The logprobs requests ask for: each sampled token's (with its most likely alternatives), and
the prompt tokens' (`sampling.prompt_logprobs`).

Logprobs are the model's raw distribution: the log-softmax of the float32 logits, before
penalties, temperature, top-k, top-p or min-p (vLLM's default, `raw_logprobs`), so they do not
depend on how a request samples and equal transformers' `log_softmax(logits)`. The work is done
only for the rows of the sequences that asked: a batch where none asks pays nothing.

Prompt logprobs need the logits of every prompt position, not only the last. `plan_logit_rows`
names the rows the model must return (`ForwardBatch.logit_rows`): every new row of a sequence
that wants prompt logprobs, the last row of the others. A prefill chunk's last row predicts the
first token of the next chunk, which the worker has not seen: its log-softmax waits in the
sequence's state (`SeqState.pending_prompt_row`) until that chunk comes.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from himamba.common.messages import PromptLogprobs, SeqPlan, TokenLogprobs
from himamba.common.types import SamplingParams
from himamba.services.worker.page_tables import SeqState


class PromptRows(NamedTuple):
    """The rows of one sequence whose logits predict its prompt tokens."""

    seq: int  # index of the sequence in the batch
    token_start: int  # index into the batch's T tokens of its first new token
    new_len: int
    row_start: int  # index into the returned rows of its first new token's row
    count: int  # its rows that predict prompt tokens (new positions prefix_len .. prefix_len + count - 1)
    prefix_len: int


class LogitRows(NamedTuple):
    """Which rows of a forward's T tokens the model returns logits for."""

    rows: torch.Tensor  # [R] int64 indices into T
    last: torch.Tensor  # [B] int64 index into `rows` of each sequence's last new token
    prompt: list[PromptRows]


def plan_logit_rows(mode: str, seqs: Sequence[SeqPlan], states: Sequence[SeqState]) -> LogitRows | None:
    """The rows to return when some sequence of a prefill wants prompt logprobs; None otherwise
    (the model then returns each sequence's last row only)."""
    if mode != "prefill" or all(s.sampling.prompt_logprobs is None for s in states):
        return None
    rows: list[int] = []
    last: list[int] = []
    prompt: list[PromptRows] = []
    tok = 0
    for i, (plan, state) in enumerate(zip(seqs, states, strict=True)):
        n, a = plan.new_len, plan.prefix_len
        # Position p predicts token p + 1: prompt tokens are 1 .. num_prompt - 1.
        count = max(0, min(n, state.num_prompt - 1 - a)) if state.sampling.prompt_logprobs is not None else 0
        if count or state.pending_prompt_row is not None:
            prompt.append(PromptRows(i, tok, n, len(rows), count, a))
        rows.extend(range(tok, tok + count))
        if count < n:
            rows.append(tok + n - 1)
        last.append(len(rows) - 1)
        tok += n
    return LogitRows(torch.tensor(rows, dtype=torch.int64), torch.tensor(last, dtype=torch.int64), prompt)


def _chosen(lp: torch.Tensor, ids: torch.Tensor) -> tuple[list[float], list[int]]:
    """Each row's logprob of its token, and that token's rank (1 + how many are more likely)."""
    chosen = lp.gather(1, ids.view(-1, 1).to(lp.device))
    rank = (lp > chosen).sum(dim=1) + 1
    return chosen.view(-1).tolist(), rank.tolist()


def _entries(
    chosen: tuple[list[float], list[int]], top_ids: list[list[int]], top_lps: list[list[float]]
) -> list[TokenLogprobs]:
    return [
        TokenLogprobs(c, ids, lps, r) for c, r, ids, lps in zip(chosen[0], chosen[1], top_ids, top_lps, strict=True)
    ]


def _top(lp: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    if k == 0:
        return [[] for _ in range(lp.shape[0])], [[] for _ in range(lp.shape[0])]
    top = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    return top.indices.tolist(), top.values.tolist()


def prompt_logprobs(
    logits: torch.Tensor, plan: LogitRows, input_ids: torch.Tensor, states: Sequence[SeqState]
) -> dict[int, PromptLogprobs]:
    """seq index -> the logprobs of the prompt tokens this forward predicted. `logits` are the
    rows of `plan.rows`; `input_ids` the batch's T tokens."""
    out: dict[int, PromptLogprobs] = {}
    for p in plan.prompt:
        state = states[p.seq]
        k = state.sampling.prompt_logprobs or 0
        ids = input_ids[p.token_start : p.token_start + p.new_len]
        lp = torch.log_softmax(logits[p.row_start : p.row_start + p.count].float(), dim=-1)
        carried = state.pending_prompt_row is not None
        if carried:
            # The previous chunk's last row predicts this chunk's first token (position prefix_len).
            lp = torch.cat([state.pending_prompt_row.view(1, -1), lp])
            state.pending_prompt_row = None
        start = p.prefix_len + (0 if carried else 1)
        # Row j predicts token start + j; this chunk holds tokens up to prefix_len + new_len - 1.
        known = min(lp.shape[0], p.new_len - (1 if not carried else 0))
        targets = ids[start - p.prefix_len : start - p.prefix_len + known]
        if known < lp.shape[0]:  # the last row predicts the next chunk's first token
            state.pending_prompt_row = lp[known].clone()
        lp = lp[:known]
        if known == 0:
            continue
        top_ids, top_lps = _top(lp, k)
        out[p.seq] = PromptLogprobs(start, _entries(_chosen(lp, targets), top_ids, top_lps))
    return out


def sampled_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[int], errors: dict[int, str]
) -> dict[int, TokenLogprobs]:
    """seq index -> its sampled token's logprob and top alternatives, for the sequences that
    asked (`logprobs`) and were sampled. `logits`: [B, V], each sequence's last row."""
    ask = [i for i, p in enumerate(params) if p.logprobs and i not in errors]
    if not ask:
        return {}
    index = torch.tensor(ask, dtype=torch.int64, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen, rank = _chosen(lp, torch.tensor([tokens[i] for i in ask], dtype=torch.int64))
    k = max(params[i].top_logprobs for i in ask)
    top_ids, top_lps = _top(lp, k)
    return {
        i: TokenLogprobs(chosen[j], top_ids[j][: params[i].top_logprobs], top_lps[j][: params[i].top_logprobs], rank[j])
        for j, i in enumerate(ask)
    }
