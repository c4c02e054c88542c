"""The one typed, frozen configuration tree of a himamba server.

`Config()` is the embedded default (== configs/default.toml, enforced by a test). Files are
TOML; command-line flags are generated from the fields (`--page-size` sets
`cache.page_size`, see config_flags.py), so no flag restates a field: each field's `doc(...)` is
its one documentation, the flag's help text. Nothing mutates a Config after load:
derived values are functions of it.
"""

from __future__ import annotations

import re
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


def doc(description: str, *aliases: str, hidden: bool = False) -> msgspec.Meta:
    """A field's documentation, its one place: the `--help` text of its flag (and the JSON schema).
    `aliases` are the vLLM/sglang spellings that mean exactly the same; `hidden` keeps a test
    hook out of `--help`."""
    extra: dict[str, Any] = {}
    if aliases:
        extra["aliases"] = aliases
    if hidden:
        extra["hidden"] = True
    return msgspec.Meta(description=description, extra=extra or None)


Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelConfig(_Section):
    """Which checkpoint to serve and how."""

    model: Annotated[
        str,
        doc(
            "The model to serve: a Hugging Face checkpoint directory (config.json, safetensors, "
            'tokenizer.json), or "demo" (a tiny random-weight NemotronH, built once).',
            "--model-path",
        ),
    ] = "demo"
    tokenizer: Annotated[
        str,
        doc(
            "A directory whose tokenizer.json (and tokenizer_config.json) to use instead of the model's; "
            '"": the model\'s.',
            "--tokenizer-path",
        ),
    ] = ""
    chat_template: Annotated[
        str,
        doc(
            "The chat template for /v1/chat/completions: a Jinja file, or the template itself; "
            '"": the checkpoint\'s (tokenizer_config.json or chat_template.jinja).'
        ),
    ] = ""
    generation_config: Annotated[
        str,
        doc(
            "Sampling defaults for requests that leave them out (temperature, top_p, top_k, min_p, "
            "repetition_penalty; max_new_tokens for max_tokens): auto: the checkpoint's generation_config.json; "
            "vllm: none (the API's own defaults); or a directory holding a generation_config.json."
        ),
    ] = "auto"
    dtype: Annotated[
        Dtype,
        doc(
            "Weights and activations dtype. auto: the checkpoint's dtype (config.json `dtype`, or "
            "`torch_dtype`) on CUDA; float32 on CPU, where the reference kernels are fastest and exact in it."
        ),
    ] = "auto"
    device: Annotated[Literal["cpu", "cuda"], doc("Where the model runs.")] = "cpu"
    tensor_parallel_size: Annotated[
        PositiveInt,
        doc(
            "Worker ranks the model is sharded over (torch.distributed: NCCL on CUDA, one GPU per rank; gloo on "
            "the CPU, the cores shared among the ranks): attention and Mamba2 by heads, MLPs and experts by "
            "intermediate rows, the head by vocabulary. NemotronH, Qwen3-Next, Granite-4.0-H, Bamba and Mamba2; "
            "head counts must divide by it (docs/serving/tensor-parallel.md).",
            "--tp-size",
            "--tp",
        ),
    ] = 1
    max_context_len: Annotated[
        PositiveInt,
        doc(
            "The longest sequence (prompt plus generated tokens) a request may reach.",
            "--max-model-len",
            "--context-length",
        ),
    ] = 4096
    served_model_name: Annotated[
        str,
        doc(
            "The model name the API reports and accepts (and the metrics' model_name label); "
            '"": the checkpoint directory\'s name.'
        ),
    ] = ""
    torch_threads: Annotated[NonNegInt, doc("Threads torch uses on CPU; 0: torch's default (all cores).")] = 0
    heap_reuse: Annotated[
        bool,
        doc(
            "Keep the worker's freed activation memory in its heap (glibc mmap threshold 32 MiB, trim threshold "
            "256 MiB) instead of unmapping it after every op, so a forward's temporaries are not faulted in afresh "
            "(CPU prefill 1.05-1.3x faster in A/B runs); costs resident memory up to the largest forward's temporaries."
        ),
    ] = True
    adaptive_threads: Annotated[
        bool,
        doc(
            "On the CPU, run each small step (up to 16 tokens: small-batch decode) on all of torch_threads, on "
            "one thread, or on one thread with the vocabulary head on all, whichever its measured step times "
            "favour: waking sleeping threads for every op of a small-batch decode step can cost more than the "
            "second thread gains."
        ),
    ] = True
    omp_spin: Annotated[
        NonNegInt,
        doc(
            "On the CPU, iterations an idle OpenMP thread of the worker spins before it sleeps (GOMP_SPINCOUNT); "
            "0: it sleeps at once (OMP_WAIT_POLICY=PASSIVE). 10000-100000 (about 0.2-2 ms here) keeps the threads "
            "awake through a step's back-to-back ops: prefill 1.1-1.2x and two-thread decode up to 1.4x faster "
            "when the server has its cores to itself, but the spinning takes that time from whatever shares them "
            "(the other services, other servers). A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins."
        ),
    ] = 0
    disable_cuda_graph: Annotated[
        bool,
        doc(
            "On CUDA, run every decode step eagerly instead of replaying the CUDA graphs captured at start-up "
            "for padded batch sizes (sglang's --disable-cuda-graph). Eager decode is launch-bound: an 8B-shaped "
            "Nemotron-H on an H200 ran 3.6x slower at batch 1. No effect on CPU."
        ),
    ] = False
    cuda_graph_max_bs: Annotated[
        PositiveInt,
        doc(
            "The largest decode batch captured in a CUDA graph (capped at max_running_requests); larger batches "
            "run eagerly. Each size costs capture time and graph memory at start-up."
        ),
    ] = 128
    max_logprobs: Annotated[
        NonNegInt,
        doc(
            "The most alternatives a request may ask for per token: top_logprobs (chat), logprobs (completions), "
            "prompt_logprobs. Logprobs are the model's raw log-softmax, before temperature and penalties."
        ),
    ] = 20


class EndpointsConfig(_Section):
    """ZeroMQ endpoints. Each service binds its own inbox; peers connect to it.

    Unset endpoints are unix sockets in the instance's private runtime directory (0700), so
    only this user reaches them; see common/runtime_dir.py."""

    instance: Annotated[
        str,
        doc(
            'This server\'s name on the host; it names its private runtime directory. "": port-<HTTP port> '
            "(required when HTTP is off)."
        ),
    ] = ""
    runtime_dir: Annotated[
        str,
        doc(
            "The directory holding the instances' runtime directories; \"\": $RUNTIME_DIRECTORY, "
            "$XDG_RUNTIME_DIR/himamba, /run/himamba for root, else <tmp>/himamba-<uid>."
        ),
    ] = ""
    zmq_endpoint: Annotated[
        str,
        doc(
            "The public endpoint ZeroMQ clients (himamba generate, the bench) connect to; "
            '"": client.sock in the instance\'s runtime directory.'
        ),
    ] = ""
    tokenizer_ipc: Annotated[str, doc("The tokenizer service's inbox; \"\": in the runtime directory.")] = ""
    scheduler_ipc: Annotated[str, doc("The scheduler service's inbox; \"\": in the runtime directory.")] = ""
    worker_ipc: Annotated[str, doc("The worker service's inbox; \"\": in the runtime directory.")] = ""
    cache_ipc: Annotated[str, doc("The cache service's inbox; \"\": in the runtime directory.")] = ""
    control_ipc: Annotated[
        str, doc("Where services report readiness and fatal errors to the launcher; \"\": in the runtime directory.")
    ] = ""
    client_send_queue: Annotated[
        PositiveInt,
        doc("Replies queued for a ZeroMQ client that does not read them; beyond, its requests are aborted."),
    ] = 65536
    max_client_connections: Annotated[
        NonNegInt,
        doc(
            "Open ZeroMQ client connections at most (beyond, the newest is closed at once; connections that do not "
            "finish the ZeroMQ/CURVE handshake in 5 s are closed too); 0: a quarter of the fd limit less a reserve."
        ),
    ] = 0
    curve_secret_key_file: Annotated[
        str,
        doc("A tcp:// client endpoint with CURVE: the server's key pair (a zmq.auth .key_secret file)."),
    ] = ""
    curve_clients_dir: Annotated[
        str, doc("With curve_secret_key_file: the directory of the public keys (.key) of the clients it accepts.")
    ] = ""
    insecure_endpoints: Annotated[
        bool,
        doc("Allow tcp:// and abstract ipc://@ endpoints, which other hosts and local users can reach."),
    ] = False


class SchedulerConfig(_Section):
    """Batching and request lifecycle policy."""

    max_running_requests: Annotated[
        PositiveInt, doc("The most requests running (admitted) at once.", "--max-num-seqs")
    ] = 64
    chunked_prefill_size: Annotated[PositiveInt, doc("The most new prompt tokens one prefill forward runs.")] = 512
    default_max_tokens: Annotated[
        NonNegInt,
        doc(
            "Tokens generated for a request that does not say max_tokens; 0: generation_config.json's "
            "max_new_tokens if it has one, else up to the context length."
        ),
    ] = 0
    mamba_scheduler_strategy: Annotated[
        Literal["no_buffer", "extra_buffer", "extra_buffer_lazy", "single_buffer"],
        doc(
            "How decoded text reaches the prefix cache (states copied aside every --mamba-track-interval): "
            "no_buffer (prompts only), extra_buffer (two track slots per request), extra_buffer_lazy (one, "
            "a second on demand at each boundary), single_buffer (one, overwritten in place)."
        ),
    ] = "extra_buffer_lazy"
    mamba_track_interval: Annotated[
        PositiveInt, doc("Tokens between recurrent states cached while decoding (a multiple of the page size).")
    ] = 64
    disable_overlap: Annotated[
        bool,
        doc("Run scheduling and the forward one after the other instead of overlapped.", "--disable-overlap-schedule"),
    ] = False


class CacheConfig(_Section):
    """Memory pools and the tiered prefix cache."""

    page_size: Annotated[PositiveInt, doc("Tokens per KV page: the granularity of prefix-cache hits.")] = 16
    max_total_tokens: Annotated[NonNegInt, doc("Device KV capacity in tokens; 0: derived from --memory-fraction.")] = 0
    max_mamba_cache_size: Annotated[
        NonNegInt, doc("Device recurrent-state slots; 0: derived from --memory-fraction.")
    ] = 0
    disable_radix_cache: Annotated[bool, doc("Turn the prefix cache off (every prompt is computed in full).")] = False
    enable_hierarchical_cache: Annotated[
        bool, doc("Back the device pools with host (RAM) pools and the storage tier.")
    ] = True
    hicache_ratio: Annotated[
        float, msgspec.Meta(gt=0), doc("Each host pool's size as a multiple of its device pool.")
    ] = 2.0
    hicache_size_gb: Annotated[
        NonNegFloat,
        doc(
            "Host pools in GB (1e9 bytes), split like the device pools; overrides --hicache-ratio; 0: unused.",
            "--hicache-size",
        ),
    ] = 0.0
    hicache_tokens: Annotated[
        NonNegInt, doc("Host KV capacity in tokens; overrides the size and ratio for the KV pool; 0: unused.")
    ] = 0
    hicache_mamba_slots: Annotated[
        NonNegInt, doc("Host recurrent-state slots; overrides the size and ratio for the state pool; 0: unused.")
    ] = 0
    hicache_write_policy: Annotated[
        Literal["write_back", "write_through", "write_through_selective"],
        doc(
            "When device pages are copied to host: on eviction (write_back), at once (write_through), "
            "or once reused (write_through_selective)."
        ),
    ] = "write_through"
    eviction_policy: Annotated[
        Literal["lru", "scan_resistant"],
        doc(
            "Which cached prefixes go first: least recently used, or lru that protects prefixes used more "
            "than once from one-off scans.",
            "--radix-eviction-policy",
        ),
    ] = "lru"
    memory_fraction: Annotated[
        float,
        msgspec.Meta(gt=0, le=1),
        doc(
            "The share of device memory the pools get when their sizes are derived; of free or total memory, "
            "see --memory-fraction-of."
        ),
    ] = 0.25
    memory_fraction_of: Annotated[
        Literal["free", "total"],
        doc(
            "What --memory-fraction is a share of. free: the pools get that share of the memory free once "
            "the weights are loaded; total: "
            "this server keeps everything under that share of total memory (sglang's --mem-fraction-static, "
            "vLLM's --gpu-memory-utilization) and the pools get what is left under that."
        ),
    ] = "free"
    # The storage tier (L3): where host pages are backed up and prefetched from.
    # Off unless asked (as in vLLM and sglang, nothing is written to disk by default); a directory
    # given with no other backend asks for the file backend (see `load`).
    hicache_storage_backend: Annotated[
        Literal["none", "file", "mooncake", "redis"],
        doc(
            "The storage tier (L3) behind the host pools; off by default. A --hicache-storage-dir turns the "
            "file backend on."
        ),
    ] = "none"
    hicache_storage_dir: Annotated[
        str,
        doc(
            'The file backend\'s directory (giving one turns the file backend on); "": '
            "$XDG_CACHE_HOME/himamba/storage."
        ),
    ] = ""
    hicache_storage_group: Annotated[
        str,
        doc(
            "A group that may read the file backend's values (files 0640, directories 0750, given to that "
            'group); "": the server\'s user alone (0600, 0700).'
        ),
    ] = ""
    hicache_storage_max_bytes: Annotated[
        NonNegInt,
        doc("The file backend's size cap in bytes, over its whole directory; 0: a tenth of the free space at start."),
    ] = 0
    hicache_storage_url: Annotated[
        str,
        doc(
            'The storage server: redis://host:port/db, or the Mooncake master\'s host:port; "": the localhost default.'
        ),
    ] = ""
    mooncake_metadata_server: Annotated[
        str, doc("Mooncake's metadata server; \"\": the master's embedded one, http://<master host>:8080/metadata.")
    ] = ""
    mooncake_protocol: Annotated[Literal["tcp", "rdma"], doc("Mooncake's transfer protocol.")] = "tcp"
    hicache_storage_prefetch_policy: Annotated[
        Literal["best_effort", "wait_complete", "timeout"],
        doc(
            "How long admission waits for a storage prefetch: not at all (a hybrid model's fetch with no stored"
            " state before its end: until it completes, at most the timeout), until it completes, or up to a timeout."
        ),
    ] = "timeout"
    prefetch_threshold: Annotated[NonNegInt, doc("Storage hits shorter than this many tokens are not prefetched.")] = (
        256
    )
    prefetch_timeout_base_s: Annotated[
        NonNegFloat, doc("With the timeout policy: seconds a prefetch may take, plus the per-token part, capped.")
    ] = 2.0
    prefetch_timeout_per_ki_token_s: Annotated[
        NonNegFloat, doc("With the timeout policy: seconds added per 1024 prefetched tokens.")
    ] = 0.1
    prefetch_timeout_max_s: Annotated[
        NonNegFloat, doc("With the timeout policy: the cap on a prefetch's timeout, in seconds.")
    ] = 30.0


class LogConfig(_Section):
    """What the services log."""

    level: Annotated[
        Literal["debug", "info", "warning", "error"],
        doc("The log level of every service (the HIMAMBA_LOG_LEVEL environment variable wins).", "--log-level"),
    ] = "info"
    stats_interval_s: Annotated[
        NonNegFloat,
        doc(
            "Seconds between the stats lines (throughput, requests, cache hits, pool use) logged while "
            "serving; 0: none."
        ),
    ] = 10.0


class HttpConfig(_Section):
    """The OpenAI-compatible HTTP front door (served by the tokenizer service) and /metrics."""

    host: Annotated[
        str, doc("The HTTP address to listen on; loopback by default, as the API has no TLS of its own.")
    ] = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535), doc("The HTTP port; 0: no HTTP server.")] = 30000
    api_key: Annotated[
        str,
        doc(
            'The key clients send as `Authorization: Bearer <key>` on /v1/* (ZeroMQ clients: `api_key` in each '
            'request); "": none. The HIMAMBA_API_KEY environment variable sets it without showing it in `ps`.'
        ),
    ] = ""
    access_log: Annotated[bool, doc("Log one line per HTTP request (method, path, status, size, time).")] = False
    max_connections: Annotated[
        NonNegInt,
        doc("Open HTTP connections at most (beyond: 503); 0, and at most: the fd limit less a reserve."),
    ] = 0
    request_timeout_s: Annotated[
        float,
        msgspec.Meta(gt=0),
        doc("A connection's next request head must arrive within this (idle and slow clients are closed)."),
    ] = 10.0
    body_timeout_s: Annotated[
        float, msgspec.Meta(gt=0), doc("A request body must arrive within this, else 408.")
    ] = 30.0
    shutdown_timeout_s: Annotated[
        float,
        msgspec.Meta(ge=0),
        doc(
            "On SIGTERM, in-flight requests get this long to finish (new ones are refused with 503); the rest "
            "then end with a 503 'server shutting down' error.",
            "--shutdown-timeout",
        ),
    ] = 10.0
    allowed_origins: Annotated[
        str,
        doc(
            'Browser origins allowed to call the API (CORS), comma-separated (or a JSON list, as vLLM\'s); "*": any; '
            '"": none (no CORS headers are sent).'
        ),
    ] = ""
    tool_call_parser: Annotated[
        Literal[
            "auto",
            "none",
            "hermes",
            "nemotron_json",
            "qwen3_coder",
            "qwen3_xml",
            "llama3_json",
            "mistral",
            "pythonic",
            "granite",
        ],
        doc(
            "How /v1/chat/completions reads tool calls in the model's answer (tool_choice auto): hermes: JSON "
            "in <tool_call> tags (Qwen3-Next, Granite-4.0-H, Falcon-H1); nemotron_json: <TOOLCALL>[...]"
            "</TOOLCALL> (Nemotron Nano v2); qwen3_coder (qwen3_xml): <tool_call><function=...><parameter=...> "
            "(Qwen3-Coder, Nemotron 3); llama3_json: name/parameters JSON calls (Llama 3.x); mistral: "
            "[TOOL_CALLS] (Mistral); pythonic: [f(a=1), g()] (Llama 3.2 pythonic, ToolACE); granite: "
            "<|tool_call|>[...] (Granite 3.x); auto: the format the chat template shows; none: tool_choice auto "
            "is a 400."
        ),
    ] = "auto"
    reasoning_parser: Annotated[
        Literal["none", "auto", "qwen3", "deepseek_r1"],
        doc(
            "Split <think>...</think> out of chat answers into reasoning_content: qwen3: when the answer "
            "(or the prompt's end) opens <think>; deepseek_r1: from the first token until </think>; auto: "
            "qwen3 when the chat template mentions <think>; none: the thinking stays in the content."
        ),
    ] = "none"
    responses_store_max: Annotated[
        NonNegInt,
        doc(
            "Responses (/v1/responses with store: true) kept for previous_response_id and GET, at most; the least "
            "recently used go first; 0: none is kept (the response says store: false)."
        ),
    ] = 1000
    responses_store_mib: Annotated[
        NonNegInt,
        doc("The stored responses' size budget in MiB (their JSON); beyond it the least recently used go first."),
    ] = 64
    responses_store_max_age_s: Annotated[
        NonNegInt,
        doc(
            "A stored response older than this (seconds since its created_at) is gone: previous_response_id and "
            "GET answer 404, here and from the shared store; 0: no age limit."
        ),
    ] = 86400
    responses_shared: Annotated[
        bool,
        doc(
            "With a file or redis storage tier (--hicache-storage-backend), stored responses are written there "
            "too (same count and size bounds, over the whole tier), so every server sharing it continues and "
            "reads them; false: this server's memory only. Response ids name their server (--instance, else "
            "<host>-<port>)."
        ),
    ] = True


class MetricsConfig(_Section):
    """How the services report their Prometheus metrics to the one scrape endpoint."""

    report_interval_s: Annotated[
        float, msgspec.Meta(gt=0, le=60), doc("Seconds between each service's metrics reports to /metrics.")
    ] = 1.0


class DebugConfig(_Section):
    """Test hooks (fault injection), all off by default: the [debug] table, flags `--debug-...`, hidden from
    --help. Tests and failure drills set them; a production server never needs one."""

    fail_lazy_alloc: Annotated[
        bool, doc("Test hook: every lazy track-slot allocation of the scheduler fails.", hidden=True)
    ] = False
    # The storage backend is wrapped in a FlakyBackend when either of the first two is set.
    storage_fail_rate: Annotated[
        float, msgspec.Meta(ge=0, le=1), doc("Test hook: the share of storage calls that fail.", hidden=True)
    ] = 0.0
    storage_slow_s: Annotated[NonNegFloat, doc("Test hook: seconds every storage call sleeps.", hidden=True)] = 0.0
    storage_prefetch_stall_pages: Annotated[
        NonNegInt, doc("Test hook: a storage prefetch holds after this many pages until it is revoked.", hidden=True)
    ] = 0
    # The worker's copy path: 1-based counts over the worker's life of the copy orders in
    # `transfer_direction`; 0: off.
    transfer_direction: Annotated[
        Literal["any", "d2h", "h2d"], doc("Test hook: which copy orders the copy hooks count.", hidden=True)
    ] = "any"
    transfer_fail_at: Annotated[NonNegInt, doc("Test hook: the Nth copy order fails.", hidden=True)] = 0
    batch_fail_at_transfer: Annotated[
        NonNegInt, doc("Test hook: the batch carrying the Nth copy order fails after its copies.", hidden=True)
    ] = 0
    worker_exit_at_transfer: Annotated[
        NonNegInt, doc("Test hook: the worker process dies during the Nth copy order (once per instance).", hidden=True)
    ] = 0


class Config(_Section):
    """A whole server: every service reads the same tree."""

    model: ModelConfig = ModelConfig()
    endpoints: EndpointsConfig = EndpointsConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    log: LogConfig = LogConfig()
    http: HttpConfig = HttpConfig()
    metrics: MetricsConfig = MetricsConfig()
    debug: DebugConfig = DebugConfig()


class ConfigError(ValueError):
    """A config file or flag that does not validate; the message names the flag and the field."""


# Sections whose flags carry the section's name; every other flag is flat (`--page-size`).
_PREFIXED_SECTIONS = frozenset({"debug"})


def flag_of(section: str, field: str) -> str:
    """The command-line flag of config field `section.field`: flat names (`--page-size` for
    cache.page_size), except the test hooks, `--debug-transfer-fail-at` for debug.transfer_fail_at."""
    name = f"{section}_{field}" if section in _PREFIXED_SECTIONS else field
    return "--" + name.replace("_", "-")


def field_name(section: str, field: str) -> str:
    """How errors name a field: its flag and where it sits in a config file."""
    return f"{flag_of(section, field)} ({section}.{field})"


_PATH = re.compile(r"`\$\.([a-z_]+)\.([a-z_]+)`")


def _name_fields(message: str) -> str:
    """msgspec says `$.cache.page_size`; users know the flag."""
    return _PATH.sub(lambda m: field_name(m.group(1), m.group(2)), message)


def load(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """Read a TOML file (or start from the defaults), apply per-section overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as f:
            data = f.read()
        # JSON by name, or by content (`serve` hands its services the config through a pipe,
        # /dev/fd/N; no TOML document starts with "{").
        is_json = str(path).endswith(".json") or data.lstrip()[:1] == b"{"
        raw = msgspec.json.decode(data) if is_json else tomllib.loads(data.decode("utf-8"))
    for section, fields in (overrides or {}).items():
        raw.setdefault(section, {}).update(fields)
    cache = raw.get("cache")
    if isinstance(cache, dict) and cache.get("hicache_storage_dir") and "hicache_storage_backend" not in cache:
        # A directory is the opt-in to the disk tier; a backend named anywhere (even "none": the
        # operator's opt-out) is never overridden by it.
        cache["hicache_storage_backend"] = "file"
    try:
        cfg = msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid config: {_name_fields(str(e))}") from None
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field rules that a single field's type cannot say."""
    s, c = cfg.scheduler, cfg.cache
    interval, page = field_name("scheduler", "mamba_track_interval"), field_name("cache", "page_size")
    if s.mamba_track_interval % c.page_size:
        raise ConfigError(
            f"{interval} = {s.mamba_track_interval} must be a multiple of {page} = {c.page_size}: "
            "states are only reusable at page boundaries"
        )
    if s.chunked_prefill_size < c.page_size:
        raise ConfigError(
            f"{field_name('scheduler', 'chunked_prefill_size')} = {s.chunked_prefill_size} "
            f"must be >= {page} = {c.page_size}"
        )
    if c.max_total_tokens and c.max_total_tokens < c.page_size:
        raise ConfigError(
            f"{field_name('cache', 'max_total_tokens')} = {c.max_total_tokens} "
            f"is smaller than one page ({page} = {c.page_size})"
        )


class ResolvedDtype(NamedTuple):
    """What `--dtype` comes to for one checkpoint and device, and why (for the start-up log)."""

    dtype: str
    why: str


_SERVED_DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(model: ModelConfig, checkpoint_config: dict[str, Any]) -> ResolvedDtype:
    """The one definition of `--dtype auto`: the checkpoint's dtype on CUDA (transformers 5 writes
    `dtype`, older versions `torch_dtype`), float32 on CPU (the PyTorch reference kernels have no
    faster half-precision path there, and float32 matches transformers exactly)."""
    if model.dtype != "auto":
        return ResolvedDtype(model.dtype, "as --dtype asks")
    name = checkpoint_config.get("dtype") or checkpoint_config.get("torch_dtype") or "float32"
    if model.device == "cpu":
        return ResolvedDtype("float32", f"--dtype auto on cpu; the checkpoint's is {name}")
    if name not in _SERVED_DTYPES:
        raise ConfigError(
            f"{field_name('model', 'dtype')}: auto found the checkpoint's dtype {name!r}, "
            "which himamba does not serve; "
            f"pass one of {', '.join(_SERVED_DTYPES)}"
        )
    return ResolvedDtype(name, f"--dtype auto: the checkpoint's, on {model.device}")


def to_toml_dict(cfg: Config) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def sections() -> list[tuple[str, type[_Section]]]:
    """(name, struct) of each section of Config, in order."""
    hints = typing.get_type_hints(Config)
    return [(name, hints[name]) for name in Config.__struct_fields__]


class FieldInfo(NamedTuple):
    """One config field as the command line sees it."""

    section: str
    field: str
    type: Any  # the annotation, constraints included
    base: Any  # bool, int, float, str or a Literal
    default: Any
    doc: str
    aliases: tuple[str, ...]
    hidden: bool

    @property
    def flag(self) -> str:
        return flag_of(self.section, self.field)


def fields() -> list[FieldInfo]:
    """Every config field with its documentation (from its `doc(...)`)."""
    out = []
    for section, cls in sections():
        hints = typing.get_type_hints(cls, include_extras=True)
        for field in cls.__struct_fields__:
            hint = hints[field]
            base, metas = hint, ()
            if typing.get_origin(hint) is Annotated:
                base, *rest = typing.get_args(hint)
                metas = tuple(m for m in rest if isinstance(m, msgspec.Meta))
            description = next((m.description for m in metas if m.description), "")
            extra: dict[str, Any] = {}
            for m in metas:
                extra.update(m.extra or {})
            out.append(
                FieldInfo(
                    section,
                    field,
                    hint,
                    base,
                    getattr(cls(), field),
                    description,
                    tuple(extra.get("aliases", ())),
                    bool(extra.get("hidden")),
                )
            )
    return out


def encode(cfg: Config) -> bytes:
    """Serialise a Config to hand it to a child process."""
    return msgspec.json.encode(cfg)


def decode(data: bytes) -> Config:
    return msgspec.json.decode(data, type=Config)
