"""The one typed, frozen configuration tree of a himamba server.

`Config()` is the embedded default (== configs/default.toml, enforced by a test). Files are
TOML; command-line flags are generated from the fields (`--page-size` sets
`cache.page_size`), so no flag restates a field. Nothing mutates a Config after load:
derived values are functions of it.
"""

from __future__ import annotations

import argparse
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelConfig(_Section):
    """Which checkpoint to serve and how."""

    model: str = "demo"  # an HF checkpoint dir, or "demo" (a tiny random-weight NemotronH, built once)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda"] = "cpu"
    max_context_len: PositiveInt = 4096
    served_model_name: str = ""  # defaults to the checkpoint dir name
    torch_threads: NonNegInt = 0  # 0: torch's default (all cores)


class EndpointsConfig(_Section):
    """ZeroMQ endpoints. Each service binds its own inbox; peers connect to it."""

    zmq_endpoint: str = "ipc://@himamba-client"  # the public client endpoint (ROUTER)
    tokenizer_ipc: str = "ipc://@himamba-tokenizer"
    scheduler_ipc: str = "ipc://@himamba-scheduler"
    worker_ipc: str = "ipc://@himamba-worker"
    cache_ipc: str = "ipc://@himamba-cache"
    control_ipc: str = "ipc://@himamba-control"  # readiness and fatal reports to the launcher


class SchedulerConfig(_Section):
    """Batching and request lifecycle policy."""

    max_running_requests: PositiveInt = 64
    chunked_prefill_size: PositiveInt = 512  # max new tokens of one prefill forward
    default_max_tokens: PositiveInt = 128
    mamba_scheduler_strategy: Literal["no_buffer", "extra_buffer", "extra_buffer_lazy", "single_buffer"] = "extra_buffer_lazy"
    mamba_track_interval: PositiveInt = 64
    disable_overlap: bool = False
    debug_fail_lazy_alloc: bool = False  # test hook: every lazy track-slot allocation fails


class CacheConfig(_Section):
    """Memory pools and the tiered prefix cache."""

    page_size: PositiveInt = 16
    max_total_tokens: NonNegInt = 0  # device KV capacity in tokens; 0: derive from free memory
    max_mamba_cache_size: NonNegInt = 0  # device recurrent-state slots; 0: derive
    disable_radix_cache: bool = False
    enable_hierarchical_cache: bool = True
    hicache_ratio: Annotated[float, msgspec.Meta(gt=0)] = 2.0  # each host pool = its device pool x ratio
    hicache_size_gb: NonNegFloat = 0.0  # host pools in GB (1e9 B), split like the device pools; overrides the ratio
    hicache_tokens: NonNegInt = 0  # host KV capacity in tokens; overrides size and ratio for the KV pool
    hicache_mamba_slots: NonNegInt = 0  # host recurrent-state slots; overrides size and ratio for the state pool
    hicache_write_policy: Literal["write_back", "write_through", "write_through_selective"] = "write_through"
    eviction_policy: Literal["lru", "scan_resistant"] = "lru"
    memory_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.25  # of free memory, when deriving sizes
    # The storage tier (L3): where host pages are backed up and prefetched from.
    hicache_storage_backend: Literal["none", "file", "mooncake", "redis"] = "file"
    hicache_storage_dir: str = ""  # file backend; "": $XDG_CACHE_HOME/himamba/storage
    hicache_storage_max_bytes: NonNegInt = 0  # file backend's cap; 0: none
    hicache_storage_url: str = ""  # redis://host:port/db, or the Mooncake master's host:port; "": localhost default
    mooncake_metadata_server: str = ""  # "": the master's embedded one, http://<master host>:8080/metadata
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    hicache_storage_prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = "timeout"
    prefetch_threshold: NonNegInt = 256  # tokens: shorter storage hits are not worth a prefetch
    prefetch_timeout_base_s: NonNegFloat = 2.0  # timeout policy: base + per_ki_token * tokens / 1024, capped
    prefetch_timeout_per_ki_token_s: NonNegFloat = 0.1
    prefetch_timeout_max_s: NonNegFloat = 30.0
    # Test hooks: wrap the storage backend in a FlakyBackend (fault injection).
    debug_storage_fail_rate: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    debug_storage_slow_s: NonNegFloat = 0.0


class LogConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"


class HttpConfig(_Section):
    """The OpenAI-compatible HTTP front door (served by the tokenizer service) and /metrics."""

    host: str = "127.0.0.1"  # loopback unless told otherwise: the API has no TLS of its own
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 30000  # 0: no HTTP server
    api_key: str = ""  # "": no key; else clients send `Authorization: Bearer <key>` on /v1/*


class MetricsConfig(_Section):
    """How the services report their Prometheus metrics to the one scrape endpoint."""

    report_interval_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 1.0


class Config(_Section):
    """A whole server: every service reads the same tree."""

    model: ModelConfig = ModelConfig()
    endpoints: EndpointsConfig = EndpointsConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()
    log: LogConfig = LogConfig()
    http: HttpConfig = HttpConfig()
    metrics: MetricsConfig = MetricsConfig()


class ConfigError(ValueError):
    """A config file or flag that does not validate; the message names the field."""


def load(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """Read a TOML file (or start from the defaults), apply per-section overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as f:
            raw = msgspec.json.decode(f.read()) if str(path).endswith(".json") else tomllib.load(f)
    for section, fields in (overrides or {}).items():
        raw.setdefault(section, {}).update(fields)
    try:
        cfg = msgspec.convert(raw, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid config: {e}") from None
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field rules that a single field's type cannot say."""
    s, c = cfg.scheduler, cfg.cache
    if s.mamba_track_interval % c.page_size:
        raise ConfigError(
            f"scheduler.mamba_track_interval ({s.mamba_track_interval}) must be a multiple of "
            f"cache.page_size ({c.page_size}): states are only reusable at page boundaries"
        )
    if s.chunked_prefill_size < c.page_size:
        raise ConfigError(f"scheduler.chunked_prefill_size ({s.chunked_prefill_size}) must be >= cache.page_size ({c.page_size})")
    if c.max_total_tokens and c.max_total_tokens < c.page_size:
        raise ConfigError(f"cache.max_total_tokens ({c.max_total_tokens}) is smaller than one page ({c.page_size})")


def to_toml_dict(cfg: Config) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def _flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _sections() -> list[tuple[str, type[_Section]]]:
    hints = typing.get_type_hints(Config)
    return [(name, hints[name]) for name in Config.__struct_fields__]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field (flat names: `--page-size`). Values are validated at load."""
    seen: dict[str, str] = {}
    for section, cls in _sections():
        hints = typing.get_type_hints(cls, include_extras=True)
        group = parser.add_argument_group(f"{section} (config [{section}])")
        for field in cls.__struct_fields__:
            flag = _flag_name(field)
            if flag in seen:
                raise AssertionError(f"config field {section}.{field} collides with {seen[flag]} as {flag}")
            seen[flag] = f"{section}.{field}"
            default = getattr(cls(), field)
            base = typing.get_origin(hints[field]) or hints[field]
            if base is Annotated:
                base = typing.get_args(hints[field])[0]
            dest = f"cfg__{section}__{field}"
            help_text = f"[{section}] default: {default!r}"
            if base is bool:
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            elif typing.get_origin(hints[field]) is Literal:
                choices = typing.get_args(hints[field])
                group.add_argument(flag, dest=dest, choices=choices, default=None, help=help_text)
            else:
                group.add_argument(flag, dest=dest, type=str, default=None, help=help_text)


def overrides_from_args(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Collect the flags the user gave, typed by the field (strings are parsed as TOML values)."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if not key.startswith("cfg__") or value is None:
            continue
        _, section, field = key.split("__", 2)
        if isinstance(value, str):
            value = _parse_scalar(value)
        out.setdefault(section, {})[field] = value
    return out


def _parse_scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare string such as a path


def config_from_args(args: argparse.Namespace) -> Config:
    """The Config a CLI invocation asks for: `--config FILE` (optional) plus flags."""
    return load(getattr(args, "config", None), overrides_from_args(args))


def encode(cfg: Config) -> bytes:
    """Serialise a Config to hand it to a child process."""
    return msgspec.json.encode(cfg)


def decode(data: bytes) -> Config:
    return msgspec.json.decode(data, type=Config)
