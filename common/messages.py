"""Every message that crosses a process boundary, and one tagged union per inbox.

Commands are imperatives (`AddRequest`, `RunBatch`, `CacheStep`); results are outcomes
(`BatchDone`, `CacheStepDone`, `TokenBatch`). Tensors never sit inside a Struct: they ride as
extra ZeroMQ frames and are referenced by `TensorRef` (see `wire.py`).

The public client protocol (`ClientRequest` / `ClientReply`) is map-encoded and documented in
docs/api/zeromq.md; internal messages may change between versions.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

from himamba.common.host_layout import HostPoolLayout
from himamba.common.types import CachedTokens, FinishReason, GrammarSpec, SamplingParams, Usage


class Message(msgspec.Struct, tag=True, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every wire message. The class name is the tag."""


class TensorRef(msgspec.Struct, frozen=True, array_like=True):
    """A tensor carried as raw frame number `frame` (counted after the header frame)."""

    dtype: str
    shape: tuple[int, ...]
    frame: int


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One position's logprobs (the model's raw log-softmax): the token's own, and the `top`
    most likely tokens there, by id, best first (ties: the lower id first), with theirs."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int = 0  # the token's rank in the distribution (1: the most likely)


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """The logprobs of prompt tokens `start`, `start + 1`, ... (absolute positions, >= 1)."""

    start: int
    entries: list[TokenLogprobs]


# ---------------------------------------------------------------- client <-> tokenizer (public)

MAX_RID_CHARS = 256  # a client's request id: the front door keeps it for the request's life
ClientRid = Annotated[str, msgspec.Meta(max_length=MAX_RID_CHARS)]


class GenerateRequest(Message):
    """A client asks for a completion of `prompt` (text) or `input_ids` (token ids)."""

    rid: ClientRid = ""  # chosen by the client (unique per connection); empty: the server picks one
    prompt: str | None = None
    input_ids: list[int] | None = None
    sampling: SamplingParams = SamplingParams()
    stream: bool = True
    api_key: str = ""  # required (the server's --api-key) when the server has one


class AbortGenerate(Message):
    """A client gives up on a request; its resources are freed everywhere."""

    rid: ClientRid


class GenerateChunk(Message):
    """A streamed delta (stream=True) or the whole answer (stream=False, finished=True) of one
    sample; a request with `sampling.n` samples ends after one finished chunk per sample."""

    rid: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None  # on the first chunk when the prompt was text
    index: int = 0  # which sample (0 .. n-1) of the request this chunk belongs to
    # sampling.top_logprobs > 0: each token's logprob with its alternatives (one per token_ids entry).
    top_logprobs: list[TokenLogprobs] | None = None
    # sampling.prompt_logprobs: prompt tokens 1.. (token 0 has none), on the first chunk of sample 0.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # finish_reason "stop", on the finished chunk: what stopped it. vLLM's `stop_reason`: the stop
    # string or stop_token_ids entry (None for EOS); sglang's `matched_stop`: that, or the EOS id.
    stop_reason: int | str | None = None
    matched_stop: int | str | None = None


class ErrorReply(Message):
    """A request (or an undecodable message) was refused; the server keeps serving."""

    message: str
    rid: str = ""
    code: int = 400


ClientRequest = Union[GenerateRequest, AbortGenerate]
ClientReply = Union[GenerateChunk, ErrorReply]


# ---------------------------------------------------------------- tokenizer -> scheduler


class AddRequest(Message):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    max_tokens: int  # resolved against the server default and the context length
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    # n > 1: the samples of one client request arrive together. `siblings` (on sample 0) names the
    # other samples; each of those carries `first` = sample 0's rid and waits for its prefill, so
    # it finds the prompt in the cache. Admission of sample 0 reserves every sibling's state slots.
    siblings: list[str] = []
    first: str = ""


class AbortRequest(Message):
    rid: str


class StopRequest(Message):
    """The tokenizer saw a stop string in the text: finish the request with reason `stop`."""

    rid: str


# ---------------------------------------------------------------- scheduler -> tokenizer


class TokenOut(Message, array_like=True):
    rid: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached: CachedTokens | None = None  # set once, on the first output of a request
    error: str = ""
    top_logprobs: list[TokenLogprobs] | None = None  # sampling.top_logprobs > 0: one per token
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., with the first token


class TokenBatch(Message):
    """New tokens of several requests from one scheduler step."""

    outs: list[TokenOut]


# ---------------------------------------------------------------- scheduler -> worker


class SeqPlan(msgspec.Struct, frozen=True, array_like=True):
    """One sequence of a RunBatch. Its new tokens are a slice of the batch's `input_ids`.

    The worker keeps each running sequence's page table (and sampling state) between steps, so a
    step carries only what changed: `table[page_start:page_start + num_new_pages]` is overwritten
    (or extended) with the next `num_new_pages` entries of the batch's `pages` tensor. `reset`
    starts a fresh table (a new admission); only then are `sampling`, `history` and `num_prompt`
    sent.
    """

    rid: str
    prefix_len: int  # tokens already in KV (and reflected in the state slot)
    new_len: int
    state_slot: int
    state_init: Literal["keep", "zero", "copy"] = "keep"
    state_src: int = 0  # the slot to copy from when state_init == "copy"
    captures: list[tuple[int, int]] = []  # (offset into the new tokens, destination slot)
    step: int = 0  # number of tokens generated so far (seeds the per-request sampler)
    reset: bool = False
    page_start: int = 0
    num_new_pages: int = 0
    sampling: SamplingParams | None = None  # with `reset`
    # With `reset`, when a repetition/frequency/presence penalty is set: the context tokens before
    # `prefix_len` (served from cache); the worker counts every token it is fed after them.
    history: list[int] = []
    num_prompt: int = 0  # context[:num_prompt] is the prompt
    # In a batch that `follows` another: the sequence leaves this step if the token it sampled
    # there is one of these (its stop tokens).
    stop_ids: list[int] = []


class Transfer(msgspec.Struct, frozen=True, array_like=True):
    """A copy order between device and host pools, acknowledged to the cache controller."""

    op_id: int
    direction: Literal["d2h", "h2d"]
    kv_src: list[int]  # pages
    kv_dst: list[int]
    state_src: list[int] = []  # slots
    state_dst: list[int] = []


class RunBatch(Message):
    """Run one forward (prefill or decode) and sample one token per sequence.

    Frames: input_ids [T] int64, pages [sum(num_new_pages)] int64. Transfers run before the forward;
    `dropped` sequences (finished or retracted) lose their page tables first.

    A decode step sent before the results of the step it continues sets `follows` to that step's
    batch id: each sequence is fed the token it sampled there (`input_ids` is empty), and leaves
    the step (`BatchDone.left_out`) when that token is one of its `stop_ids` or its sampling failed
    there. If that step failed, or is not the worker's last one, this one fails without a forward.
    """

    batch_id: int
    mode: Literal["prefill", "decode", "none"]
    seqs: list[SeqPlan]
    input_ids: TensorRef | None = None
    pages: TensorRef | None = None
    transfers: list[Transfer] = []
    dropped: list[str] = []
    return_logits: bool = False
    follows: int = -1  # the batch whose sampled tokens are the inputs; -1: `input_ids` holds them


class ResetState(Message):
    """Zero the given recurrent-state slots (used by tests and on recovery)."""

    slots: list[int]


class PrepareGrammar(Message):
    """The front door accepted a request constrained by `grammar`: the worker builds its matcher
    now, off its step loop, and answers `GrammarReady` once it is built. The front door queues
    the request only then, so no step of the worker waits for a build. `lowered`: the grammar as
    the front door's check lowered it to llguidance's text (""; unknown), so the worker's build is
    only the library's native compile (it releases the GIL), never the conversion, which holds the
    GIL and would stall the step thread beside it."""

    grammar: GrammarSpec
    lowered: str = ""


class GrammarReady(Message):
    """The worker's template of the grammar whose `spec_key` is `key` is built (`error`: why it
    failed; the request then fails at its first step, with that reason)."""

    key: bytes
    error: str = ""


# ---------------------------------------------------------------- worker -> scheduler


class BatchDone(Message):
    batch_id: int
    next_tokens: list[int]
    # seq index -> its sampled token's logprobs (only sequences that asked for logprobs).
    token_logprobs: dict[int, TokenLogprobs] = {}
    # seq index -> logprobs of the prompt tokens this forward predicted (sampling.prompt_logprobs).
    prompt_logprobs: dict[int, PromptLogprobs] = {}
    forward_s: float = 0.0
    logits: TensorRef | None = None  # [B, V] float32 when return_logits
    error: str = ""  # the whole batch failed
    seq_errors: dict[int, str] = {}  # seq index -> why that sequence alone failed (its batch-mates did not)
    # Of a batch that `follows` another: the sequences (rids, in batch order) that left it before
    # the forward; every seq index above counts only the sequences that ran.
    left_out: list[str] = []


class WorkerInfo(Message):
    """Sent by the worker once the model is loaded: what the scheduler and cache must know."""

    vocab_size: int
    eos_token_ids: list[int]
    num_attention_layers: int
    num_recurrent_layers: int
    kv_bytes_per_token: int
    state_bytes_per_slot: int
    num_pages: int
    num_state_slots: int
    num_host_pages: int
    num_host_state_slots: int
    model_name: str
    random_weights: bool = False
    host_layout: HostPoolLayout = HostPoolLayout()
    pid: int = 0  # the worker process: a WorkerInfo with a known pid is a repeat, a new pid a restart


# ---------------------------------------------------------------- scheduler <-> cache controller
#
# Every op has exactly one result type (RESULT_OF). A result with `ok=False` and an `error` is a
# refused op (an unknown rid, a slot or page the request does not hold); `reason` on Admitted is
# a request that does not fit now.


class Admit(Message):
    """Match the prompt against the cache, lock the hit, allocate pages and state slots.

    `tokens` is the full context to compute (prompt, plus earlier generated tokens on a
    re-admission). `num_slots` = working slot + track slots the strategy needs. `reserve` names
    sibling samples (n > 1): each gets `num_slots` slots set aside now, all or nothing, which its
    own Admit later takes. Within one CacheStep, Admits are FCFS: after the first that does not
    fit, the rest are answered `blocked` without being tried.
    """

    rid: str
    tokens: list[int]
    num_slots: int = 1
    use_cache: bool = True
    reserve: list[str] = []


class Admitted(Message):
    rid: str
    ok: bool
    reason: str = ""  # why not (no memory): the scheduler keeps the request waiting
    # Not admitted yet because its storage prefetch is still running (wait_complete / timeout
    # policies): the scheduler tries the requests behind it instead of blocking on it.
    prefetching: bool = False
    blocked: bool = False  # not tried: an earlier Admit of the same step did not fit
    pages: list[int] = []  # pages for every token of `tokens` (shared prefix first)
    slots: list[int] = []  # [working, *track]
    cached_len: int = 0  # tokens served from cache (KV and state both)
    cached: CachedTokens = CachedTokens()
    state_src: int | None = None  # a tree slot to copy into the working slot before the prefill
    branch_len: int = 0  # page-aligned KV match past the cached state
    # (context position, slot): capture the state there during the prefill, then Insert it.
    captures: list[tuple[int, int]] = []


class Prefetch(Message):
    """A request entered the waiting queue: start fetching its prefix from storage into host
    memory in the background, so it is there (or partly there) when the request is admitted."""

    rid: str
    tokens: list[int]


class PrefetchStarted(Message):
    rid: str
    started: bool  # False: no storage tier, or nothing to fetch


class CancelPrefetch(Message):
    """The request is gone (aborted) before admission: revoke its prefetch."""

    rid: str


class PrefetchCancelled(Message):
    rid: str


class Extend(Message):
    """Make sure request `rid` has pages for `total_len` tokens."""

    rid: str
    total_len: int


class Extended(Message):
    rid: str
    ok: bool
    new_pages: list[int] = []
    error: str = ""


class AllocSlots(Message):
    rid: str
    num: int


class SlotsAllocated(Message):
    rid: str
    ok: bool
    slots: list[int] = []
    error: str = ""


class FreeSlots(Message):
    rid: str
    slots: list[int]


class SlotsFreed(Message):
    rid: str
    ok: bool
    error: str = ""  # a slot the request does not hold: nothing was freed


class Insert(Message):
    """Insert `tokens` (whole pages, the request's own pages) with the state in `slot`.

    The request keeps running (chunked prefill, decode tracking): the slot passes to the tree, and
    the request keeps a lock on the KV of the inserted prefix only (its state is evictable).
    """

    rid: str
    tokens: list[int]
    slot: int | None


class Inserted(Message):
    rid: str
    ok: bool = True
    pages: list[int] = []  # the canonical pages of the inserted prefix (re-point the page table)
    slot_used: bool = False
    error: str = ""


class Release(Message):
    """The request is done: insert `tokens` with the state in `slot` (if given), free the rest.
    Also gives back slots reserved for a sample that will not be admitted."""

    rid: str
    tokens: list[int] = []
    slot: int | None = None


class Released(Message):
    rid: str
    ok: bool = True
    error: str = ""


CacheOp = Union[Admit, Prefetch, CancelPrefetch, Extend, AllocSlots, FreeSlots, Insert, Release]
CacheResult = Union[
    Admitted, PrefetchStarted, PrefetchCancelled, Extended, SlotsAllocated, SlotsFreed, Inserted, Released
]
# The one result type of each op.
RESULT_OF: dict[type, type] = {
    Admit: Admitted,
    Prefetch: PrefetchStarted,
    CancelPrefetch: PrefetchCancelled,
    Extend: Extended,
    AllocSlots: SlotsAllocated,
    FreeSlots: SlotsFreed,
    Insert: Inserted,
    Release: Released,
}


class CacheStep(Message):
    step_id: int
    ops: list[CacheOp]
    cache_pid: int = 0  # the controller these ops were meant for (0: any); a new one ignores them


class CacheStepDone(Message):
    step_id: int
    results: list[CacheResult]  # one per op, in op order
    # Copy orders this step produced (backups, load-backs), in the order they must run:
    # the scheduler attaches them to its next RunBatch, before that batch's forward.
    transfers: list[Transfer] = []


class PrefetchDone(Message):
    """Prefetches the scheduler was told to wait for (`Admitted.prefetching`) are over (done,
    given up or past their deadline): admitting those requests may now succeed."""

    rids: list[str]


class TransfersDone(Message):
    """The worker ended these copy orders (sent to the cache controller): `op_ids` ran, `failed`
    did not (or not wholly): the controller rolls back what they assigned. Every order the worker
    received ends in exactly one of the two lists, whatever happened to its batch."""

    op_ids: list[int]
    failed: list[int] = []


class GetCacheStats(Message):
    """Ask the cache controller for pool occupancy (sent by tests and tools)."""

    reply_to: str
    check_invariants: bool = False


class CacheReset(Message):
    """The cache controller starts over with an empty tree and every pool free, and says why:

    - `worker_restarted`: the worker came back with empty pools;
    - `cache_started`: this is a new cache controller (`cache_pid`): whatever a scheduler held in
      a previous one is gone, and the scheduler must greet it (`Hello`) before using it;
    - `scheduler_started`: the answer to a scheduler's `Hello` (`scheduler_pid`): nothing of an
      earlier scheduler is held any more, and copies it had ordered have run or never will.
    """

    num_pages: int
    num_state_slots: int
    reason: Literal["worker_restarted", "cache_started", "scheduler_started"] = "worker_restarted"
    cache_pid: int = 0
    scheduler_pid: int = 0


class CacheStats(Message):
    free_pages: int
    total_pages: int
    free_slots: int
    total_slots: int
    free_host_pages: int = 0
    total_host_pages: int = 0
    free_host_slots: int = 0
    total_host_slots: int = 0
    cached_pages: int = 0
    cached_slots: int = 0
    running_requests: int = 0
    cache_steps: int = 0  # CacheStep round trips served since the controller started
    host_pages_protected: int = 0  # pinned by copies in flight (0 once every copy has ended)
    host_states_protected: int = 0
    failed_transfers: int = 0  # copy orders the worker reported failed (rolled back)
    invariants_ok: bool = True
    invariants_error: str = ""


class FlushCache(Message):
    """Empty this server's device and host tiers of cached prefixes (sglang's /flush_cache), sent to
    the cache controller. As in sglang, only an idle cache is flushed: no request holds cache memory,
    no copy or storage job is in flight; the storage tier keeps its entries (other servers may share
    it). The answer, a `CacheFlushed`, goes to `reply_to`."""

    flush_id: int
    reply_to: str


class CacheFlushed(Message):
    """The outcome of a FlushCache: what was freed, or why nothing was (`busy`: only copies or
    storage jobs were in flight, so the same flush will succeed shortly)."""

    flush_id: int
    ok: bool
    error: str = ""
    busy: bool = False
    device_pages: int = 0  # cached pages and states that were freed
    device_states: int = 0
    host_pages: int = 0
    host_states: int = 0


# ---------------------------------------------------------------- control (services -> launcher)


class Hello(Message):
    """A service (re)started and introduces itself to a peer: the worker answers with its
    `WorkerInfo`; the cache controller drops what an earlier scheduler held and answers with a
    `CacheReset(reason="scheduler_started")`."""

    service: str
    pid: int


class Ready(Message):
    service: str
    pid: int
    detail: str = ""


class Fatal(Message):
    service: str
    pid: int
    error: str


class Shutdown(Message):
    reason: str = ""


class Stopped(Message):
    """A service stopped cleanly after SIGTERM and says, in one clause, what the stop did (the
    front door: requests finished and aborted; the cache: backups flushed and not); the launcher's
    final line carries every service's."""

    service: str
    pid: int
    summary: str


class Draining(Message):
    """The front door began draining (front door -> cache): the whole stop should be over by
    `deadline` (time.time()), so the cache's flush of pending backups gets what the drain left."""

    deadline: float


# ---------------------------------------------------------------- metrics (services -> tokenizer)


class MetricsReport(Message):
    """A service's whole Prometheus exposition (text format), sent every few seconds.

    The tokenizer serves its own metrics plus the latest report of each other service at
    `/metrics`; every metric family is owned by exactly one service, so none repeats. A report
    also says its sender is alive and ready (services start reporting once ready).
    """

    service: str
    text: str
    pid: int = 0  # a report from a new pid means the service restarted


# ---------------------------------------------------------------- one union per inbox

ToTokenizer = Union[TokenBatch, WorkerInfo, Ready, MetricsReport, CacheFlushed, GrammarReady, Shutdown]
ToScheduler = Union[
    AddRequest, AbortRequest, StopRequest, BatchDone, CacheStepDone, PrefetchDone, CacheReset, WorkerInfo, Shutdown
]
ToWorker = Union[RunBatch, ResetState, PrepareGrammar, Hello, Shutdown]
ToCache = Union[CacheStep, TransfersDone, WorkerInfo, GetCacheStats, FlushCache, Hello, Draining, Shutdown]
ToLauncher = Union[Ready, Fatal, Stopped]
