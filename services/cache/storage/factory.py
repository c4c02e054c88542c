"""Backends by name: what `--hicache-storage-backend` may say, and how each is opened.

The remote backends are imported only when chosen, so a server on the `file` backend needs neither
redis-py nor the Mooncake wheel.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from himamba.services.cache.storage.base import StorageBackend
from himamba.services.cache.storage.file import (
    DEFAULT_CAP_FRACTION,
    FileBackend,
    default_cap,
    default_storage_dir,
    filesystem_free_bytes,
)

if TYPE_CHECKING:
    from himamba.common.config import CacheConfig

__all__ = ["STORAGE_BACKENDS", "open_backend", "open_configured_backend"]

_log = logging.getLogger("himamba.cache.storage")

STORAGE_BACKENDS: tuple[str, ...] = ("none", "file", "mooncake", "redis")


def open_backend(
    name: str,
    fingerprint: bytes,
    *,
    directory: Path | None = None,
    max_bytes: int = 0,
    url: str = "",
    group: str = "",
    mooncake_metadata_server: str = "",
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp",
) -> StorageBackend | None:
    """Open the backend called `name` for one model; None for "none" (no storage tier).

    file: `directory` (default under the user's cache dir) and `max_bytes` (0: the default cap,
    `DEFAULT_CAP_FRACTION` of the filesystem's free space at start, logged); `group` may read it.
    redis: `url` redis://host:port/db (default redis://127.0.0.1:6379/0).
    mooncake: `url` is the master's host:port (default 127.0.0.1:50051), with
    `mooncake_metadata_server` (default: the master's embedded one, http://<host>:8080/metadata)
    and `mooncake_protocol`. A remote store that is down does not fail this call: the backend
    fails fast and reconnects when it comes up."""
    if name == "none":
        return None
    if name == "file":
        if not max_bytes:
            root = directory if directory is not None else default_storage_dir()
            free = filesystem_free_bytes(root)
            max_bytes = default_cap(free)
            _log.info(
                "storage: file tier capped at %.1f GB (%d%% of the %.1f GB free on %s at start); "
                "set --hicache-storage-max-bytes to choose", max_bytes / 1e9, round(DEFAULT_CAP_FRACTION * 100),
                free / 1e9, root,
            )
        return FileBackend(fingerprint, directory, max_bytes=max_bytes, group=group)
    if name == "redis":
        try:
            from himamba.services.cache.storage.redis_backend import DEFAULT_REDIS_URL, RedisBackend
        except ImportError as e:
            raise ValueError(
                f"hicache_storage_backend: 'redis' needs redis-py (pip install 'himamba[storage]'): {e}"
            ) from None
        return RedisBackend(fingerprint, url or DEFAULT_REDIS_URL)
    if name == "mooncake":
        try:
            import mooncake.store  # noqa: F401 - fail here, with a clear message, not in a thread
        except ImportError as e:
            raise ValueError(
                "hicache_storage_backend: 'mooncake' needs the Mooncake wheel (pip install "
                "mooncake-transfer-engine, or mooncake-transfer-engine-non-cuda without CUDA; on Debian also "
                f"apt-get install libibverbs1 libnl-3-200 libnl-route-3-200): {e}"
            ) from None
        from himamba.services.cache.storage.mooncake import DEFAULT_MOONCAKE_MASTER, MooncakeBackend

        return MooncakeBackend(
            fingerprint,
            url or DEFAULT_MOONCAKE_MASTER,
            metadata_server=mooncake_metadata_server,
            protocol=mooncake_protocol,
        )
    raise ValueError(f"hicache_storage_backend: unknown backend {name!r}; choose from {', '.join(STORAGE_BACKENDS)}")


def open_configured_backend(cache: CacheConfig, fingerprint: bytes) -> StorageBackend | None:
    """`open_backend` with the settings of a server's `[cache]` config section."""
    return open_backend(
        cache.hicache_storage_backend,
        fingerprint,
        directory=Path(cache.hicache_storage_dir) if cache.hicache_storage_dir else None,
        max_bytes=cache.hicache_storage_max_bytes,
        url=cache.hicache_storage_url,
        group=cache.hicache_storage_group,
        mooncake_metadata_server=cache.mooncake_metadata_server,
        mooncake_protocol=cache.mooncake_protocol,
    )
