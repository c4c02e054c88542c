"""Every Prometheus metric of himamba, defined once: name, help, type, labels, buckets, owner.

Names are `himamba_<area>_<what>_<unit>` (counters end in `_total`). Each family is owned by
exactly one service, which alone updates and exports it (see `metrics_report.py`); the tokenizer
serves every service's families at its one `/metrics`, so a server is one scrape target.
`grafana/generate.py` builds the dashboard from this table, so names never drift. Besides
`ALL_METRICS`, every service exports its own process metrics (`PROCESS_METRICS`, labelled by
service) and the front door adds `himamba_build_info` and a `model_name` label on every series.

Label values are closed sets (`LABEL_VALUES`), and every combination is created at zero when a
service starts: a family is visible before its first event, and no series appears mid-run.
Cache effectiveness is counted in tokens (hit rate = rate(hit) / rate(query) in PromQL); pool
occupancy and transfers are in bytes, so KV pages and Mamba state slots share one unit.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Service = Literal["tokenizer", "scheduler", "worker", "cache"]
Owner = Service | Literal["every"]  # "every": each service exports its own series, labelled service=...
MetricType = Literal["counter", "gauge", "histogram"]

SERVICES: tuple[Service, ...] = ("tokenizer", "scheduler", "worker", "cache")
TIERS = ("device", "host", "storage")
LOWER_TIERS = ("host", "storage")  # the tier a backup writes to / a prefetch reads from
KINDS = ("kv", "mamba")

LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "service": SERVICES,
    "tier": TIERS,
    "kind": KINDS,
    "op": ("backup", "prefetch", "lookup"),
    "event": ("unreachable", "reconnect", "refused_write", "corrupt"),
    "strategy": ("no_buffer", "extra_buffer", "extra_buffer_lazy", "single_buffer"),
    "mode": ("prefill", "decode", "none"),
    "reason": ("stop", "length", "abort", "error"),
    "route": ("completions", "chat_completions", "models", "health", "metrics", "other"),
    "status": ("2xx", "4xx", "5xx"),
    "store_op": ("write", "read", "delete"),
}

# Latency buckets (seconds) sized for CPU test models up to large GPU deployments.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class MetricDef(NamedTuple):
    """One metric family. `labels` name keys of LABEL_VALUES; `label_values` narrows them."""

    name: str
    help: str
    type: MetricType
    service: Owner
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    label_values: tuple[tuple[str, tuple[str, ...]], ...] = ()  # per-family subsets, e.g. tier: host/storage

    def values_of(self, label: str) -> tuple[str, ...]:
        """The values `label` takes in this family."""
        return dict(self.label_values).get(label, LABEL_VALUES[label])

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The series names this family exports (what PromQL refers to)."""
        if self.type == "histogram":
            return (self.name + "_bucket", self.name + "_sum", self.name + "_count")
        return (self.name,)


_TL = ("tier", "kind")
_LOWER = (("tier", LOWER_TIERS),)

# ---------------------------------------------------------------- cache controller: pools
POOL_CAPACITY_BYTES = MetricDef(
    "himamba_pool_capacity_bytes",
    "Size of the pool of this tier and kind; storage's kinds share one cap, so there a kind's capacity is what"
    " it holds plus the shared free part (0: no cap).",
    "gauge",
    "cache",
    _TL,
)
POOL_USED_BYTES = MetricDef(
    "himamba_pool_used_bytes",
    "Allocated part of the pool (running requests and cached prefixes).",
    "gauge",
    "cache",
    _TL,
)
POOL_PROTECTED_BYTES = MetricDef(
    "himamba_pool_protected_bytes",
    "Used part that cannot be evicted now (locked by requests or pinned by transfers).",
    "gauge",
    "cache",
    _TL,
)
POOL_EVICTABLE_BYTES = MetricDef(
    "himamba_pool_evictable_bytes", "Used part held only by the prefix cache (evictable).", "gauge", "cache", _TL
)

# ---------------------------------------------------------------- cache controller: effectiveness
CACHE_QUERY_TOKENS = MetricDef(
    "himamba_cache_query_tokens_total", "Prompt tokens looked up in the prefix cache.", "counter", "cache"
)
CACHE_HIT_TOKENS = MetricDef(
    "himamba_cache_hit_tokens_total",
    "Prompt tokens served from the cache (KV and recurrent state both), by the tier they came from.",
    "counter",
    "cache",
    ("tier",),
)
CACHE_KV_HIT_TOKENS = MetricDef(
    "himamba_cache_kv_hit_tokens_total",
    "Prompt tokens whose KV pages matched, by tier; exceeds hit tokens where no state was cached.",
    "counter",
    "cache",
    ("tier",),
)
CACHE_MAMBA_STATE_HITS = MetricDef(
    "himamba_cache_mamba_state_hits_total",
    "Recurrent (Mamba) states reused from the cache, by tier.",
    "counter",
    "cache",
    ("tier",),
)
CACHE_EVICTED_BYTES = MetricDef(
    "himamba_cache_evicted_bytes_total", "Bytes evicted from the cache, by tier and kind.", "counter", "cache", _TL
)
CACHE_BACKUP_BYTES = MetricDef(
    "himamba_cache_backup_bytes_total",
    "Bytes written down to a lower tier (host or storage), counted when the copy completed.",
    "counter",
    "cache",
    _TL,
    label_values=_LOWER,
)
CACHE_BACKUP_OPS = MetricDef(
    "himamba_cache_backup_ops_total",
    "Completed backup operations, by the tier written to.",
    "counter",
    "cache",
    ("tier",),
    label_values=_LOWER,
)
CACHE_PREFETCH_BYTES = MetricDef(
    "himamba_cache_prefetch_bytes_total",
    "Bytes brought up from a lower tier (host: load-back to device; storage: prefetch to host).",
    "counter",
    "cache",
    _TL,
    label_values=_LOWER,
)
CACHE_PREFETCH_OPS = MetricDef(
    "himamba_cache_prefetch_ops_total",
    "Completed prefetch / load-back operations, by the tier read from.",
    "counter",
    "cache",
    ("tier",),
    label_values=_LOWER,
)
CACHE_TRANSFERS_IN_FLIGHT = MetricDef(
    "himamba_cache_transfers_in_flight",
    "Copy operations ordered and not yet finished, by the lower tier they move to or from.",
    "gauge",
    "cache",
    ("tier",),
    label_values=_LOWER,
)
CACHE_PREFETCH_TRUNCATIONS = MetricDef(
    "himamba_cache_prefetch_truncations_total",
    "Prefetches cut short by the adaptive prefetch length.",
    "counter",
    "cache",
)
CACHE_STORAGE_ERRORS = MetricDef(
    "himamba_cache_storage_errors_total",
    "Storage (L3) backups, lookups and prefetches that ended in an error.",
    "counter",
    "cache",
    ("op",),
)
CACHE_STORAGE_EVENTS = MetricDef(
    "himamba_cache_storage_events_total",
    "What the storage backend met: calls that could not reach the store (or were refused at once "
    "while it is away), reconnections, writes the store refused (full, read-only), values that failed "
    "verification (read as misses).",
    "counter",
    "cache",
    ("event",),
)
CACHE_STORAGE_UP = MetricDef(
    "himamba_cache_storage_up",
    "Whether the storage backend is reachable: 1 yes; 0 while it is away (calls fail fast) or with no storage tier.",
    "gauge",
    "cache",
)

# ---------------------------------------------------------------- scheduler
SCHEDULER_RUNNING = MetricDef(
    "himamba_scheduler_running_requests", "Requests admitted and running.", "gauge", "scheduler"
)
SCHEDULER_WAITING = MetricDef(
    "himamba_scheduler_waiting_requests", "Requests waiting for admission.", "gauge", "scheduler"
)
SCHEDULER_QUEUE_TIME = MetricDef(
    "himamba_scheduler_queue_time_seconds",
    "Time from arrival at the front door to first admission.",
    "histogram",
    "scheduler",
    buckets=_TTFT_BUCKETS,
)
SCHEDULER_MAMBA_TRACK_SLOTS = MetricDef(
    "himamba_scheduler_mamba_track_slots",
    "Extra recurrent-state slots held by running requests to track states, by strategy.",
    "gauge",
    "scheduler",
    ("strategy",),
)
SCHEDULER_LAZY_ALLOC_FAILURES = MetricDef(
    "himamba_scheduler_lazy_alloc_failures_total",
    "Lazy track-slot allocations refused for lack of free slots (extra_buffer_lazy).",
    "counter",
    "scheduler",
)
SCHEDULER_RETRACTIONS = MetricDef(
    "himamba_scheduler_retractions_total",
    "Running requests sent back to waiting for lack of KV pages.",
    "counter",
    "scheduler",
)
SCHEDULER_DECODE_STEPS_AHEAD = MetricDef(
    "himamba_scheduler_ahead_decode_steps_total",
    "Decode steps sent while the step they follow ran (the worker feeds them its tokens and starts "
    "them at once); the other steps wait for the scheduler to handle the previous step's tokens first.",
    "counter",
    "scheduler",
)

# ---------------------------------------------------------------- worker
WORKER_STEP_TIME = MetricDef(
    "himamba_worker_step_time_seconds",
    "Wall time of one worker step (copy orders, forward and sampling), by batch mode.",
    "histogram",
    "worker",
    ("mode",),
    buckets=_STEP_BUCKETS,
)
WORKER_STEP_TOKENS = MetricDef(
    "himamba_worker_step_tokens_total", "Tokens run through the model, by batch mode.", "counter", "worker", ("mode",)
)
WORKER_TENSOR_PARALLEL_RANKS = MetricDef(
    "himamba_worker_tensor_parallel_ranks", "Worker ranks the model is sharded over (1: not sharded).", "gauge", "worker"
)

# ---------------------------------------------------------------- tokenizer (front door)
REQUEST_PROMPT_TOKENS = MetricDef(
    "himamba_request_prompt_tokens_total", "Prompt tokens of finished requests.", "counter", "tokenizer"
)
REQUEST_GENERATION_TOKENS = MetricDef(
    "himamba_request_generation_tokens_total", "Tokens generated for finished requests.", "counter", "tokenizer"
)
REQUEST_CACHED_TOKENS = MetricDef(
    "himamba_request_cached_tokens_total",
    "Prompt tokens of finished requests that a cache tier served (as reported in usage).",
    "counter",
    "tokenizer",
    ("tier",),
)
REQUEST_FINISHED = MetricDef(
    "himamba_request_finished_total", "Finished requests, by finish reason.", "counter", "tokenizer", ("reason",)
)
REQUEST_TTFT = MetricDef(
    "himamba_request_time_to_first_token_seconds",
    "Time from arrival to the first generated token.",
    "histogram",
    "tokenizer",
    buckets=_TTFT_BUCKETS,
)
REQUEST_ITL = MetricDef(
    "himamba_request_inter_token_latency_seconds",
    "Time between consecutive generated tokens of a request.",
    "histogram",
    "tokenizer",
    buckets=_ITL_BUCKETS,
)
REQUEST_E2E = MetricDef(
    "himamba_request_e2e_latency_seconds",
    "Time from arrival to the end of a request.",
    "histogram",
    "tokenizer",
    buckets=_E2E_BUCKETS,
)
HTTP_RESPONSES = MetricDef(
    "himamba_http_responses_total",
    "HTTP responses of the front door, by route and status class.",
    "counter",
    "tokenizer",
    ("route", "status"),
)
RESPONSES_SHARED_STORE_ERRORS = MetricDef(
    "himamba_responses_shared_store_errors_total",
    "Calls to the shared store of /v1/responses that failed (a failed write leaves the response in this server's "
    "memory only; a failed read answers 503).",
    "counter",
    "tokenizer",
    ("store_op",),
)

# ---------------------------------------------------------------- every service: its own process
# Four processes serve one model: each reports its own resident memory and CPU, labelled by service
# (prometheus_client's process_* collector, renamed, since one scrape target carries all four).
PROCESS_RESIDENT_MEMORY = MetricDef(
    "himamba_process_resident_memory_bytes", "Resident memory of the service's process.", "gauge", "every", ("service",)
)
PROCESS_VIRTUAL_MEMORY = MetricDef(
    "himamba_process_virtual_memory_bytes", "Virtual memory of the service's process.", "gauge", "every", ("service",)
)
PROCESS_CPU = MetricDef(
    "himamba_process_cpu_seconds_total",
    "User and system CPU time the service's process spent.",
    "counter",
    "every",
    ("service",),
)
PROCESS_OPEN_FDS = MetricDef(
    "himamba_process_open_fds", "Open file descriptors of the service's process.", "gauge", "every", ("service",)
)
PROCESS_START_TIME = MetricDef(
    "himamba_process_start_time_seconds",
    "When the service's process started, in seconds since the Unix epoch.",
    "gauge",
    "every",
    ("service",),
)
PROCESS_METRICS: tuple[MetricDef, ...] = (
    PROCESS_RESIDENT_MEMORY,
    PROCESS_VIRTUAL_MEMORY,
    PROCESS_CPU,
    PROCESS_OPEN_FDS,
    PROCESS_START_TIME,
)

# ---------------------------------------------------------------- the server (rendered by the front door)
# What is running: 1, with the build and the settings an operator compares across a fleet as labels
# (open values, so not in LABEL_VALUES). Every series of /metrics also carries model_name.
BUILD_INFO = MetricDef(
    "himamba_build_info", "The server's version and main settings, as labels; always 1.", "gauge", "tokenizer"
)
BUILD_INFO_LABELS = (
    "version",
    "torch_version",
    "dtype",
    "device",
    "page_size",
    "max_context_len",
    "mamba_scheduler_strategy",
    "storage_backend",
)
MODEL_NAME_LABEL = "model_name"

ALL_METRICS: tuple[MetricDef, ...] = (
    POOL_CAPACITY_BYTES,
    POOL_USED_BYTES,
    POOL_PROTECTED_BYTES,
    POOL_EVICTABLE_BYTES,
    CACHE_QUERY_TOKENS,
    CACHE_HIT_TOKENS,
    CACHE_KV_HIT_TOKENS,
    CACHE_MAMBA_STATE_HITS,
    CACHE_EVICTED_BYTES,
    CACHE_BACKUP_BYTES,
    CACHE_BACKUP_OPS,
    CACHE_PREFETCH_BYTES,
    CACHE_PREFETCH_OPS,
    CACHE_TRANSFERS_IN_FLIGHT,
    CACHE_PREFETCH_TRUNCATIONS,
    CACHE_STORAGE_ERRORS,
    CACHE_STORAGE_EVENTS,
    CACHE_STORAGE_UP,
    SCHEDULER_RUNNING,
    SCHEDULER_WAITING,
    SCHEDULER_QUEUE_TIME,
    SCHEDULER_MAMBA_TRACK_SLOTS,
    SCHEDULER_LAZY_ALLOC_FAILURES,
    SCHEDULER_RETRACTIONS,
    SCHEDULER_DECODE_STEPS_AHEAD,
    WORKER_STEP_TIME,
    WORKER_STEP_TOKENS,
    WORKER_TENSOR_PARALLEL_RANKS,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    REQUEST_CACHED_TOKENS,
    REQUEST_FINISHED,
    REQUEST_TTFT,
    REQUEST_ITL,
    REQUEST_E2E,
    HTTP_RESPONSES,
    RESPONSES_SHARED_STORE_ERRORS,
)


def metrics_of(service: Service) -> tuple[MetricDef, ...]:
    """The families `service` owns and exports."""
    if service not in SERVICES:
        raise ValueError(f"service must be one of {SERVICES}, got {service!r}")
    return tuple(m for m in ALL_METRICS if m.service == service)


def exported_names() -> frozenset[str]:
    """Every series name the server exports (histograms as _bucket/_sum/_count)."""
    return frozenset(n for m in (*ALL_METRICS, *PROCESS_METRICS, BUILD_INFO) for n in m.sample_names)
