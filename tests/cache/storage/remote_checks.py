"""Contract checks shared by the remote backends' tests (redis, mooncake): each takes backends
opened on a running store and asserts what every remote backend must do."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from himamba.services.cache.storage.base import HEADER_BYTES, StorageBackend, ValueCodec, ValueKind, find_hit

FP = bytes(range(32))
OTHER_FP = bytes(range(100, 132))
PAGE = 4096
STATE = 1000


def keys(n: int) -> list[bytes]:
    """Fresh random page keys (a store is shared by the tests of a module)."""
    return [os.urandom(32) for _ in range(n)]


def pages(n: int, seed: int = 0, nbytes: int = PAGE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, nbytes), dtype=np.uint8)


def store(b: StorageBackend, ks: list[bytes], data: np.ndarray) -> list[bool]:
    return b.set_pages(ks, [memoryview(r) for r in data], token_count=16)


def read(b: StorageBackend, ks: list[bytes], nbytes: int = PAGE) -> tuple[int, np.ndarray]:
    out = np.zeros((len(ks), nbytes), dtype=np.uint8)
    return b.get_pages(ks, [memoryview(r) for r in out]), out


def check_round_trip(b: StorageBackend) -> None:
    ks, data = keys(5), pages(5)
    before = b.stats()
    assert store(b, ks, data) == [True] * 5
    n, out = read(b, ks)
    assert n == 5 and np.array_equal(out, data)
    state = np.arange(STATE, dtype=np.uint32).view(np.uint8)[:STATE].copy()
    assert b.set_state(ks[2], memoryview(state))
    got = np.zeros(STATE, dtype=np.uint8)
    assert b.get_state(ks[2], memoryview(got)) and np.array_equal(got, state)
    assert not b.get_state(ks[3], memoryview(got))
    assert store(b, ks[:2], data[:2]) == [True, True]  # already stored: acknowledged, not resent
    s = b.stats()
    assert s.num_written_pages - before.num_written_pages == 5
    assert s.num_read_pages - before.num_read_pages == 5
    assert (s.num_written_states - before.num_written_states, s.num_read_states - before.num_read_states) == (1, 1)
    assert s.num_skipped_writes - before.num_skipped_writes == 2
    assert s.num_misses - before.num_misses == 1
    assert s.num_written_bytes - before.num_written_bytes == 5 * (HEADER_BYTES + PAGE) + HEADER_BYTES + STATE
    assert s.num_errors == before.num_errors
    assert b.set_pages([], []) == [] and b.get_pages([], []) == 0 and b.exists([]) == 0


def check_prefix_semantics(b: StorageBackend) -> None:
    ks, data = keys(6), pages(6, seed=1)
    assert store(b, ks[:3] + ks[4:5], np.concatenate([data[:3], data[4:5]])) == [True] * 4
    assert b.exists(ks) == 3  # stops at the first absent page, whatever follows
    n, out = read(b, ks)
    assert n == 3 and np.array_equal(out[:3], data[:3])
    assert b.set_state(ks[1], memoryview(pages(1, nbytes=STATE)[0]))
    assert b.exists_states(ks) == [False, True, False, False, False, False]
    hit = find_hit(b, ks, needs_state=True)
    assert (hit.num_kv_pages, hit.num_pages) == (3, 2)


def check_verification(
    b: StorageBackend, write_raw: Callable[[str, bytes], None], name_of: Callable[[bytes, ValueKind], str]
) -> None:
    """A value written by anything but a backend of this model is a miss, counted as corrupt."""
    ks, data = keys(4), pages(4, seed=2)
    codec = ValueCodec(FP)
    before = b.stats()
    # 0: garbage; 1: another model's header; 2: a flipped payload byte; 3: a truncated value.
    write_raw(name_of(ks[0], ValueKind.KV), b"not a himamba value at all")
    other = ValueCodec(OTHER_FP)
    write_raw(name_of(ks[1], ValueKind.KV), other.header(ValueKind.KV, ks[1], data[1]) + data[1].tobytes())
    flipped = data[2].copy()
    flipped[100] ^= 0x01
    write_raw(name_of(ks[2], ValueKind.KV), codec.header(ValueKind.KV, ks[2], data[2]) + flipped.tobytes())
    write_raw(name_of(ks[3], ValueKind.KV), (codec.header(ValueKind.KV, ks[3], data[3]) + data[3].tobytes())[:-10])
    for i, k in enumerate(ks):
        n, _ = read(b, [k])
        assert n == 0, f"value {i} was accepted"
    # The state of page 0 stored as its KV (wrong kind) is refused too.
    write_raw(
        name_of(ks[0], ValueKind.STATE), codec.header(ValueKind.KV, ks[0], data[0][:STATE]) + data[0][:STATE].tobytes()
    )
    assert not b.get_state(ks[0], memoryview(np.zeros(STATE, dtype=np.uint8)))
    s = b.stats()
    assert s.num_corrupt - before.num_corrupt == 5
    assert s.num_read_pages == before.num_read_pages


def check_full_store(b: StorageBackend, num_pages: int, nbytes: int) -> tuple[int, int]:
    """Write far more than the store holds: writes are refused or older pages evicted, and every
    read returns either nothing or exactly what was written. Returns (acknowledged, readable)."""
    ks, data = keys(num_pages), pages(num_pages, seed=3, nbytes=nbytes)
    acked = 0
    for i in range(0, num_pages, 8):
        acked += sum(store(b, ks[i : i + 8], data[i : i + 8]))
    readable = 0
    for i, k in enumerate(ks):
        n, out = read(b, [k], nbytes)
        if n:
            assert np.array_equal(out[0], data[i]), f"page {i} came back with other bytes"
            readable += 1
    assert b.stats().num_corrupt == 0
    return acked, readable


def check_sharing(first: StorageBackend, second: StorageBackend) -> None:
    """Two backends on one store (two servers) see each other's pages and states."""
    ks, data = keys(4), pages(4, seed=4)
    assert store(first, ks, data) == [True] * 4
    assert second.exists(ks) == 4
    n, out = read(second, ks)
    assert n == 4 and np.array_equal(out, data)
    state = pages(1, seed=5, nbytes=STATE)[0]
    assert second.set_state(ks[3], memoryview(state))
    got = np.zeros(STATE, dtype=np.uint8)
    assert first.get_state(ks[3], memoryview(got)) and np.array_equal(got, state)
    assert store(second, ks[:1], data[:1]) == [True]  # already there: acknowledged
    assert second.stats().num_skipped_writes >= 1


def check_other_process_reads(open_code: str, b: StorageBackend) -> None:
    """A page written here is read back by a separate Python process (another server)."""
    ks, data = keys(3), pages(3, seed=6)
    assert store(b, ks, data) == [True] * 3
    script = "\n".join(
        [
            "import hashlib, sys",
            "import numpy as np",
            open_code,
            "ks = [bytes.fromhex(h) for h in sys.argv[1:]]",
            f"out = np.zeros((len(ks), {PAGE}), dtype=np.uint8)",
            "n = b.get_pages(ks, [memoryview(r) for r in out])",
            "print(n, hashlib.sha256(out.tobytes()).hexdigest())",
            "b.close()",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", script, *(k.hex() for k in ks)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1].split()
    assert last == ["3", hashlib.sha256(data.tobytes()).hexdigest()]


def check_outage_calls(b: StorageBackend, ks: list[bytes]) -> None:
    """Calls while the store is away answer misses / refused writes, never raise, and count."""
    before = b.stats().num_errors
    data = pages(len(ks), seed=7)
    for _ in range(3):
        assert b.exists(ks) == 0
        assert b.exists_states(ks) == [False] * len(ks)
        assert read(b, ks)[0] == 0
        assert store(b, ks, data) == [False] * len(ks)
        assert not b.get_state(ks[0], memoryview(np.zeros(STATE, dtype=np.uint8)))
        assert not b.set_state(ks[0], memoryview(np.zeros(STATE, dtype=np.uint8)))
    assert b.stats().num_errors - before >= 18


def wait_until_served(b: StorageBackend, timeout_s: float = 60.0) -> None:
    """Poll until a write and its read succeed again (the backend reconnected on its own)."""
    ks, data = keys(2), pages(2, seed=8)
    deadline = time.monotonic() + timeout_s
    while True:
        if all(store(b, ks, data)):
            n, out = read(b, ks)
            if n == 2 and np.array_equal(out, data):
                return
        assert time.monotonic() < deadline, f"the backend did not recover in {timeout_s} s: {b.stats()}"
        time.sleep(0.1)
