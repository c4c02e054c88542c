"""A request as the scheduler sees it, through its life: waiting -> running -> finished.

`context` = prompt + generated tokens. `computed_len` tokens of it have their KV in the pool
and are reflected in the working state slot. A forward computes `context[computed_len:...]`;
when it reaches the end of the context, the sampled token is a new output token.
A retracted request goes back to waiting with its output kept and is recomputed on re-admission.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from himamba.common.messages import TokenLogprobs
from himamba.common.types import CachedTokens, FinishReason, SamplingParams

Status = Literal["waiting", "running", "finished"]


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    eos_ids: frozenset[int]
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # sampling.prompt_logprobs (scheduler/logprobs.py): prompt positions 1.. as computed so far.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_gap: bool = False
    prompt_logprobs_sent: bool = False
    status: Status = "waiting"
    finish_reason: FinishReason | None = None
    # Resources granted by the cache controller while running.
    pages: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # [working, *track]
    computed_len: int = 0
    state_init: Literal["keep", "zero", "copy"] = "zero"
    state_src: int = 0
    # Absolute context positions where the state must be captured, with the slot it goes to.
    pending_captures: list[tuple[int, int]] = field(default_factory=list)
    last_state_len: int = 0  # the longest prefix for which a state was given to the tree
    # Decode-time tracking (mamba_track.py): slots holding tracked states, ping-pong index,
    # the newest complete tracked state and where it was taken.
    track_slots: list[int] = field(default_factory=list)
    next_track: int = 0
    newest_track_slot: int | None = None
    last_track_len: int = 0
    # The worker's copy of `pages` (worker_batch.py): the next step starts a fresh table
    # (`table_reset`), or sends pages[min(pages_sent, pages_dirty):].
    table_reset: bool = True
    pages_sent: int = 0
    pages_dirty: int = 1 << 62
    # n > 1 (samples.py): sample 0 names its siblings, a sibling names sample 0 (`first`).
    siblings: list[str] = field(default_factory=list)
    first: str = ""
    reserved: bool = False  # the controller holds this sibling's slots (reserved by sample 0)
    prefetching: bool = False  # told to wait for its storage prefetch (until PrefetchDone)
    cached: CachedTokens | None = None
    cached_reported: bool = False
    abort_requested: bool = False
    stop_requested: bool = False
    num_retractions: int = 0
    first_token_time: float | None = None
    # The tokens that stop it: `check_stop`'s token tests, for the worker to apply to a token the
    # scheduler has not seen yet (decode_ahead.py). Fixed for the request's life.
    stop_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        stops = set() if self.sampling.ignore_eos else set(self.eos_ids)
        stops.update(self.sampling.stop_token_ids or ())
        self.stop_ids = sorted(stops)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def context_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return len(self.prompt_ids) + len(self.output_ids) - self.computed_len

    def tokens(self, start: int, n: int) -> list[int]:
        """context[start:start + n] without building the whole context (a decode step's cost must
        not grow with the context)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : start - p + n]
        if start + n <= p:
            return self.prompt_ids[start : start + n]
        return self.prompt_ids[start:] + self.output_ids[: start + n - p]

    @property
    def working_slot(self) -> int:
        return self.slots[0]

    def release_resources(self) -> None:
        self.pages = []
        self.slots = []
        self.pending_captures = []
        self.computed_len = 0
        self.state_init = "zero"
        self.last_state_len = 0
        self.track_slots = []
        self.next_track = 0
        self.newest_track_slot = None
        self.last_track_len = 0
        self.table_reset = True
        self.pages_sent = 0
        self.pages_dirty = 1 << 62
