"""A decode step sent before the results of the step it continues (`RunBatch.follows`).

At steady decode the scheduler knows the next step but not its tokens: they are what the
current step samples. It sends the next step while the current one runs, so the worker starts
it without waiting for the scheduler's round trip; the worker fills in each sequence's token
from the step it follows, and leaves out the sequences that token stops (their `stop_ids`) or
whose sampling failed there. The scheduler decides the same from the same results, so the two
agree on which sequences ran without another message (`BatchDone.left_out` lets it check).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
import torch

from himamba.common.messages import BatchDone, RunBatch
from himamba.common.wire import get_tensor, tensor_frame, tensor_ref


class FollowError(ValueError):
    """A step follows one that failed or was not the worker's last: it cannot run."""


class LastSampled(NamedTuple):
    """What the worker's last step sampled: the inputs of a step that follows it."""

    batch_id: int
    tokens: dict[str, int]  # rid -> sampled token, for the sequences whose sampling succeeded


class Resolved(NamedTuple):
    """A following step made ordinary: its inputs filled in, the sequences that left removed."""

    msg: RunBatch
    frames: list[Any]
    left_out: list[str]  # rids, in batch order


def sampled(msg: RunBatch, done: BatchDone) -> LastSampled | None:
    """The tokens a step that follows `msg` reads (None when `msg` failed as a whole)."""
    if done.error or len(done.next_tokens) != len(msg.seqs):
        return None
    errors = done.seq_errors
    return LastSampled(
        msg.batch_id, {s.rid: t for i, (s, t) in enumerate(zip(msg.seqs, done.next_tokens)) if i not in errors}
    )


def resolve(msg: RunBatch, frames: list[Any], last: LastSampled | None) -> Resolved:
    """`msg` (which follows `last`) with its input tokens and without the sequences that left."""
    if last is None or last.batch_id != msg.follows:
        raise FollowError(f"batch {msg.batch_id} follows batch {msg.follows}, which failed or did not run last")
    pages = get_tensor(frames, msg.pages).tolist() if msg.pages is not None else []
    seqs, ids, kept_pages, left_out = [], [], [], []
    start = 0
    for seq in msg.seqs:
        seq_pages = pages[start : start + seq.num_new_pages]
        start += seq.num_new_pages
        token = last.tokens.get(seq.rid)
        if seq.new_len != 1:
            raise FollowError(f"batch {msg.batch_id}: a following step feeds one token per sequence")
        if token is None or token in seq.stop_ids:
            left_out.append(seq.rid)
            continue
        seqs.append(seq)
        ids.append(token)
        kept_pages += seq_pages
    ids_t = torch.tensor(ids, dtype=torch.int64)
    pages_t = torch.tensor(kept_pages, dtype=torch.int64)
    plain = msgspec.structs.replace(
        msg, seqs=seqs, input_ids=tensor_ref(ids_t, 0), pages=tensor_ref(pages_t, 1), follows=-1
    )
    return Resolved(plain, [tensor_frame(ids_t), tensor_frame(pages_t)], left_out)
