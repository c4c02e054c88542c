"""The file backend: round trips, restarts, corruption, read-only stores, prefixes, races, the cap."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from himamba.services.cache.storage.base import HEADER_BYTES, StorageHit, find_hit
from himamba.services.cache.storage.file import FileBackend, default_storage_dir

FP = bytes(range(32))
OTHER_FP = bytes(range(100, 132))
PAGE = 256


def _keys(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 16 for i in range(n)]


def _pages(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, PAGE), dtype=np.uint8)


def _read(b: FileBackend, keys: list[bytes]) -> tuple[int, np.ndarray]:
    out = np.zeros((len(keys), PAGE), dtype=np.uint8)
    return b.get_pages(keys, [memoryview(r) for r in out]), out


def _store(b: FileBackend, keys: list[bytes], pages: np.ndarray) -> list[bool]:
    return b.set_pages(keys, [memoryview(r) for r in pages], token_count=16)


def test_pages_and_states_round_trip_and_are_counted(tmp_path: Path) -> None:
    b = FileBackend(FP, tmp_path)
    keys, pages = _keys(5), _pages(5)
    assert _store(b, keys, pages) == [True] * 5
    n, out = _read(b, keys)
    assert n == 5 and np.array_equal(out, pages)
    state = np.arange(100, dtype=np.uint8)
    assert b.set_state(keys[2], memoryview(state))
    got = np.zeros(100, dtype=np.uint8)
    assert b.get_state(keys[2], memoryview(got)) and np.array_equal(got, state)
    assert not b.get_state(keys[3], memoryview(got))
    assert b.exists_states(keys) == [False, False, True, False, False]
    assert _store(b, keys[:2], pages[:2]) == [True, True]  # already there: skipped, still acknowledged
    s = b.stats()
    assert (s.num_written_pages, s.num_read_pages, s.num_written_states, s.num_read_states) == (5, 5, 1, 1)
    assert s.num_skipped_writes == 2 and s.num_misses == 1
    assert s.num_written_bytes == 5 * (HEADER_BYTES + PAGE) + HEADER_BYTES + 100


def test_a_new_instance_on_the_same_directory_serves_earlier_pages(tmp_path: Path) -> None:
    keys, pages = _keys(4), _pages(4)
    first = FileBackend(FP, tmp_path)
    _store(first, keys, pages)
    first.close()
    second = FileBackend(FP, tmp_path)
    assert second.exists(keys) == 4
    n, out = _read(second, keys)
    assert n == 4 and np.array_equal(out, pages)
    # Another model on the same root sees nothing.
    assert FileBackend(OTHER_FP, tmp_path).exists(keys) == 0


def test_a_closed_backend_refuses_calls(tmp_path: Path) -> None:
    b = FileBackend(FP, tmp_path)
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.exists(_keys(1))


def _file(b: FileBackend, key: bytes, suffix: str = ".kv") -> Path:
    return b.dir / key.hex()[:2] / (key.hex() + suffix)


@pytest.mark.parametrize("damage", ["payload_bit", "header_bit", "checksum_bit", "truncate", "extend", "empty"])
def test_a_damaged_file_is_a_counted_miss_and_is_deleted(tmp_path: Path, damage: str) -> None:
    b = FileBackend(FP, tmp_path)
    keys, pages = _keys(4), _pages(4)
    _store(b, keys, pages)
    path = _file(b, keys[2])
    data = bytearray(path.read_bytes())
    if damage == "payload_bit":
        data[HEADER_BYTES + 17] ^= 0x01
    elif damage == "header_bit":
        data[10] ^= 0x40  # payload length
    elif damage == "checksum_bit":
        data[HEADER_BYTES - 1] ^= 0x80
    elif damage == "truncate":
        data = data[: len(data) - 5]
    elif damage == "extend":
        data += b"x"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    n, out = _read(b, keys)
    assert n == 2 and np.array_equal(out[:2], pages[:2])
    assert b.stats().num_corrupt == 1
    assert not path.exists()
    assert b.exists(keys) == 2
    # The page can be stored again and then serves normally.
    assert _store(b, keys[2:3], pages[2:3]) == [True]
    assert _read(b, keys)[0] == 4


def test_a_value_under_the_wrong_name_or_model_is_a_miss(tmp_path: Path) -> None:
    b = FileBackend(FP, tmp_path)
    keys, pages = _keys(2), _pages(2)
    _store(b, keys[:1], pages[:1])
    _file(b, keys[1]).parent.mkdir(parents=True, exist_ok=True)
    _file(b, keys[1]).write_bytes(_file(b, keys[0]).read_bytes())  # a valid value, misplaced
    assert _read(b, keys[1:])[0] == 0
    other = FileBackend(OTHER_FP, tmp_path)
    _file(other, keys[0]).parent.mkdir(parents=True, exist_ok=True)
    _file(other, keys[0]).write_bytes(_file(b, keys[0]).read_bytes())  # another model's value
    assert _read(other, keys[:1])[0] == 0
    assert b.stats().num_corrupt == 1 and other.stats().num_corrupt == 1


def test_a_buffer_of_another_size_never_receives_a_page(tmp_path: Path) -> None:
    b = FileBackend(FP, tmp_path)
    _store(b, _keys(1), _pages(1))
    small = np.zeros(PAGE // 2, dtype=np.uint8)
    assert b.get_pages(_keys(1), [memoryview(small)]) == 0
    assert not small.any()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(present=st.sets(st.integers(0, 11)))
def test_exists_is_the_longest_run_of_present_keys_from_the_start(tmp_path: Path, present: set[int]) -> None:
    b = FileBackend(FP, tmp_path / os.urandom(4).hex())
    keys, pages = _keys(12), _pages(12)
    for i in present:
        _store(b, [keys[i]], pages[i : i + 1])
    expected = next(i for i in range(13) if i not in present)
    assert b.exists(keys) == expected
    assert _read(b, keys)[0] == expected


def test_find_hit_ends_a_hybrid_hit_at_a_stored_state(tmp_path: Path) -> None:
    b = FileBackend(FP, tmp_path)
    keys, pages = _keys(8), _pages(8)
    _store(b, keys[:6], pages[:6])
    assert find_hit(b, keys, needs_state=True) == StorageHit(6, 0)
    b.set_state(keys[1], b"s" * 10)
    b.set_state(keys[3], b"s" * 10)
    b.set_state(keys[7], b"s" * 10)  # beyond the KV prefix: unusable
    assert find_hit(b, keys, needs_state=True) == StorageHit(6, 4, (2, 4))
    assert find_hit(b, keys, needs_state=False) == StorageHit(6, 6)
    assert find_hit(b, keys[:3], needs_state=True) == StorageHit(3, 2, (2,))


def test_a_read_only_store_refuses_writes_cleanly_and_logs_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    keys, pages = _keys(6), _pages(6)
    b = FileBackend(FP, tmp_path)
    _store(b, keys[:2], pages[:2])
    real_open = os.open

    def read_only_open(path, flags, *args):  # type: ignore[no-untyped-def]
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only_open)
    with caplog.at_level(logging.WARNING, logger="himamba.cache.storage"):
        assert _store(b, keys[2:], pages[2:]) == [False] * 4
        assert not b.set_state(keys[0], b"s")
    assert sum("fail" in r.getMessage() for r in caplog.records) == 1
    assert b.stats().num_refused_writes == 5
    assert not list(b.dir.rglob("*.tmp"))
    n, out = _read(b, keys)  # what was stored still serves
    assert n == 2 and np.array_equal(out[:2], pages[:2])


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_a_chmod_read_only_directory_refuses_writes(tmp_path: Path) -> None:
    b = FileBackend(FP, tmp_path)
    os.chmod(b.dir, 0o555)
    try:
        assert _store(b, _keys(2), _pages(2)) == [False, False]
    finally:
        os.chmod(b.dir, 0o755)


def test_an_unusable_directory_refuses_writes_and_misses_reads(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    b = FileBackend(FP, blocker)
    assert _store(b, _keys(2), _pages(2)) == [False, False]
    assert b.exists(_keys(2)) == 0 and _read(b, _keys(2))[0] == 0
    assert b.stats().num_refused_writes == 2


def test_concurrent_writers_and_readers_of_the_same_keys(tmp_path: Path) -> None:
    keys, pages = _keys(4), _pages(4)
    errors: list[str] = []
    start = threading.Barrier(8)

    def writer() -> None:
        b = FileBackend(FP, tmp_path)  # separate instances race like separate processes
        start.wait()
        for _ in range(20):
            if not all(_store(b, keys, pages)):
                errors.append("refused")

    def reader() -> None:
        b = FileBackend(FP, tmp_path)
        start.wait()
        for _ in range(40):
            n, out = _read(b, keys)
            if not np.array_equal(out[:n], pages[:n]):
                errors.append("torn read")
            if b.stats().num_corrupt:
                errors.append("corrupt")

    threads = [threading.Thread(target=writer) for _ in range(4)] + [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert _read(FileBackend(FP, tmp_path), keys)[0] == 4
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_size_cap_evicts_least_recently_used_files(tmp_path: Path) -> None:
    value = HEADER_BYTES + PAGE
    b = FileBackend(FP, tmp_path, max_bytes=5 * value, low_watermark=0.6)
    keys, pages = _keys(10), _pages(10)
    assert _store(b, keys[:5], pages[:5]) == [True] * 5
    for i, k in enumerate(keys[:5]):  # distinct, old recencies: key 0 oldest
        os.utime(_file(b, k), (1_000_000 + i, 1_000_000 + i))
    assert _read(b, keys[:1])[0] == 1  # a hit refreshes key 0
    assert _store(b, keys[5:6], pages[5:6]) == [True]
    s = b.stats()
    assert s.num_evicted == 3 and s.used_bytes <= 5 * value and s.capacity_bytes == 5 * value
    present = [_file(b, k).exists() for k in keys[:6]]
    assert present == [True, False, False, False, True, True]
    assert _store(b, keys[6:], pages[6:]) == [True] * 4
    assert len(list(b.dir.rglob("*.kv"))) <= 5
    # A restart counts what is on disk.
    assert FileBackend(FP, tmp_path, max_bytes=5 * value).stats().used_bytes == b.stats().used_bytes


def test_a_value_larger_than_the_cap_is_refused(tmp_path: Path) -> None:
    b = FileBackend(FP, tmp_path, max_bytes=PAGE)
    assert _store(b, _keys(1), _pages(1)) == [False]
    assert b.stats().num_refused_writes == 1


def test_default_directory_follows_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_storage_dir() == tmp_path / "himamba" / "storage"
    assert FileBackend(FP).dir == tmp_path / "himamba" / "storage" / FP.hex()
