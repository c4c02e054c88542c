"""Backends by name: what `--hicache-storage-backend` may say, and how each is opened."""

from __future__ import annotations

from pathlib import Path

from himamba.services.cache.storage.base import StorageBackend
from himamba.services.cache.storage.file import FileBackend

__all__ = ["STORAGE_BACKENDS", "open_backend"]

# Distributed backends (mooncake, redis) register here, one module each.
STORAGE_BACKENDS: tuple[str, ...] = ("none", "file")


def open_backend(
    name: str, fingerprint: bytes, *, directory: Path | None = None, max_bytes: int = 0
) -> StorageBackend | None:
    """Open the backend called `name` for one model; None for "none" (no storage tier).
    `directory` (file: default under the user's cache dir) and `max_bytes` (0: no cap)."""
    if name == "none":
        return None
    if name == "file":
        return FileBackend(fingerprint, directory, max_bytes=max_bytes)
    raise ValueError(f"hicache_storage_backend: unknown backend {name!r}; choose from {', '.join(STORAGE_BACKENDS)}")
