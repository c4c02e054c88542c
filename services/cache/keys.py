"""Storage keys of token pages: a hash chained from the parent page's key, salted with the model.

    key_0 = SHA256(fingerprint || tokens_0)            tokens as 4-byte little-endian ids
    key_i = SHA256(fingerprint || key_{i-1} || tokens_i)

A key therefore names a whole prefix (every token before and in the page), and the fingerprint
(architecture, dtype, page size, weights digest) keeps two models from ever sharing entries. Every
page of one fingerprint hashes the same number of token bytes, so a first page and a chained page
can never be confused. A recurrent state is stored under the key of the page where it was
captured (the storage backend adds the component suffix).
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Sequence
from pathlib import Path

KEY_BYTES = 32  # SHA-256: collision-resistant even against crafted prompts in a shared store
FINGERPRINT_BYTES = 32
# Bumped whenever the bytes stored for a page change meaning (host layout, header, key scheme).
KEY_SCHEME_VERSION = 1
_SAMPLE_BYTES = 1 << 20  # content digest: the first and last MiB of each weights file
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

__all__ = ["FINGERPRINT_BYTES", "KEY_BYTES", "model_fingerprint", "page_keys"]


def model_fingerprint(model_dir: Path, dtype: str, page_size: int, tp_size: int = 1) -> bytes:
    """A 32-byte digest of what makes stored pages interchangeable: config.json, the dtype, the
    page size, the tensor-parallel size (a sharded page holds every rank's shard, rank after rank),
    and a cheap digest of every weights file (name, size, safetensors header, first and last MiB). It reads a few MiB per file, never the whole weights. ValueError when `model_dir`
    has no config.json."""
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    if not config.is_file():
        raise ValueError(f"model_dir: {model_dir} has no config.json")
    if page_size <= 0:
        raise ValueError(f"page_size: must be > 0, got {page_size}")
    h = hashlib.sha256()
    h.update(f"himamba-storage-v{KEY_SCHEME_VERSION}\0{dtype}\0{page_size}\0".encode())
    if tp_size > 1:  # TP=1 keys stay what they were
        h.update(f"tp{tp_size}\0".encode())
    _update_chunk(h, config.read_bytes())
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)):
        _digest_weights_file(h, path)
    return h.digest()


def _update_chunk(h: hashlib._Hash, data: bytes) -> None:
    # Length-prefixed so that two adjacent fields can never trade bytes.
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def _digest_weights_file(h: hashlib._Hash, path: Path) -> None:
    size = path.stat().st_size
    _update_chunk(h, path.name.encode())
    h.update(struct.pack("<Q", size))
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            # The header names every tensor with its dtype, shape and offsets.
            (n,) = struct.unpack("<Q", f.read(8))
            if 0 < n <= min(size - 8, 100 << 20):
                _update_chunk(h, f.read(n))
        f.seek(0)
        _update_chunk(h, f.read(_SAMPLE_BYTES))
        if size > _SAMPLE_BYTES:
            f.seek(max(_SAMPLE_BYTES, size - _SAMPLE_BYTES))
            _update_chunk(h, f.read(_SAMPLE_BYTES))


def page_keys(parent_key: bytes | None, tokens: Sequence[int], page_size: int, fingerprint: bytes) -> list[bytes]:
    """Keys of the whole pages of `tokens`, chained from `parent_key` (the key of the page just
    before `tokens[0]`; None at the start of a sequence). A trailing partial page has no key:
    the result has len(tokens) // page_size entries. Token ids must fit in 32 bits."""
    if page_size <= 0:
        raise ValueError(f"page_size: must be > 0, got {page_size}")
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint: must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    if parent_key is not None and len(parent_key) != KEY_BYTES:
        raise ValueError(f"parent_key: must be {KEY_BYTES} bytes, got {len(parent_key)}")
    num_pages = len(tokens) // page_size
    if num_pages == 0:
        return []
    try:
        packed = array.array("I", tokens[: num_pages * page_size])
    except (OverflowError, TypeError) as e:
        raise ValueError(f"tokens: every id must be an int in [0, 2**32): {e}") from None
    assert packed.itemsize == 4, "array('I') is 32-bit on every supported platform"
    if sys.byteorder == "big":
        packed.byteswap()
    data = memoryview(packed).cast("B")
    salted = hashlib.sha256(fingerprint)
    step = page_size * 4
    keys: list[bytes] = []
    prev = parent_key
    for start in range(0, num_pages * step, step):
        h = salted.copy()
        if prev is not None:
            h.update(prev)
        h.update(data[start : start + step])
        prev = h.digest()
        keys.append(prev)
    return keys
