"""n > 1: one client request, n samples of the same prompt.

Each sample is its own scheduler request (rid per sample index, see `requests.py`), and all are
sent at once. Sample 0 names its siblings; each sibling names sample 0. The scheduler admits
sample 0 with every sibling's state slots reserved (all or nothing: samples never wait on each
other for slots) and holds the siblings until sample 0's prefill is done, so they find the prompt
in the cache and compute only its last tokens instead of all of it n times.
"""

from __future__ import annotations

import msgspec

from himamba.common.messages import AddRequest
from himamba.common.types import SamplingParams


def sample_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """How sample `index` samples: alone (n = 1), with seed + index when seeded, so that the
    samples differ from each other and each is reproducible. Only sample 0 computes the prompt
    logprobs (they are the same for every sample; the others then reuse its prefill)."""
    if sampling.n == 1:
        return sampling
    seed = None if sampling.seed is None else sampling.seed + index
    prompt_logprobs = sampling.prompt_logprobs if index == 0 else None
    return msgspec.structs.replace(sampling, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def sample_requests(
    rids: list[str],
    input_ids: list[int],
    sampling: SamplingParams,
    *,
    max_tokens: int,
    eos_token_ids: list[int],
    arrival_time: float,
) -> list[AddRequest]:
    """The scheduler requests of a request's samples, one per rid (in sample order)."""
    if len(rids) != sampling.n:
        raise ValueError(f"rids: expected {sampling.n} (one per sample), got {len(rids)}")
    return [
        AddRequest(
            rid=rid,
            input_ids=input_ids,
            sampling=sample_sampling(sampling, i),
            max_tokens=max_tokens,
            eos_token_ids=eos_token_ids,
            arrival_time=arrival_time,
            siblings=rids[1:] if i == 0 else [],
            first=rids[0] if i > 0 else "",
        )
        for i, rid in enumerate(rids)
    ]
