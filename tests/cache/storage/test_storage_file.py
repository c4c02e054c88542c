"""The file backend: round trips, restarts, corruption, read-only stores, prefixes, races, the cap."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from himamba.services.cache.storage.base import HEADER_BYTES, StorageHit, ValueKind, find_hit
from himamba.services.cache.storage.factory import open_backend
from himamba.services.cache.storage.file import (
    DEFAULT_CAP_FRACTION,
    FileBackend,
    default_cap,
    default_storage_dir,
)

FP = bytes(range(32))
OTHER_FP = bytes(range(100, 132))
PAGE = 256
_NOBODY = 65534  # the overflow uid: owns nothing on the machine


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


def _record(b: FileBackend, key: bytes, kind: ValueKind = ValueKind.KV) -> tuple[Path, int, int]:
    """(segment file, offset, payload bytes) of a stored value."""
    seg, off, nbytes = b._index[(kind, key)]
    return Path(seg.path), off, nbytes


def _segments(b: FileBackend) -> list[Path]:
    return sorted(b.dir.glob("*.seg"))


@pytest.mark.parametrize("damage", ["payload_bit", "header_bit", "checksum_bit"])
def test_a_damaged_value_is_a_counted_miss_and_is_forgotten(tmp_path: Path, damage: str) -> None:
    b = FileBackend(FP, tmp_path)
    keys, pages = _keys(4), _pages(4)
    _store(b, keys, pages)
    path, off, _ = _record(b, keys[2])
    data = bytearray(path.read_bytes())
    if damage == "payload_bit":
        data[off + HEADER_BYTES + 17] ^= 0x01
    elif damage == "header_bit":
        data[off + 10] ^= 0x40  # payload length
    else:
        data[off + HEADER_BYTES - 1] ^= 0x80
    path.write_bytes(bytes(data))
    n, out = _read(b, keys)
    assert n == 2 and np.array_equal(out[:2], pages[:2])
    assert b.stats().num_corrupt == 1
    assert b.exists(keys) == 2
    # The page can be stored again and then serves normally.
    assert _store(b, keys[2:3], pages[2:3]) == [True]
    assert _read(b, keys)[0] == 4


def test_a_corrupt_value_makes_the_read_check_its_whole_batch(tmp_path: Path) -> None:
    """Every value damaged: the first read forgets all of the batch's bad values (not only the
    first), so one backup writes them all again and the next read is a full hit."""
    b = FileBackend(FP, tmp_path)
    keys, pages = _keys(6), _pages(6)
    _store(b, keys, pages)
    b.close()
    for path in tmp_path.rglob("*.seg"):
        data = bytearray(path.read_bytes())
        for i in range(6):
            data[i * (HEADER_BYTES + PAGE) + HEADER_BYTES + 5] ^= 0x01
        path.write_bytes(bytes(data))
    b = FileBackend(FP, tmp_path)
    assert b.exists(keys) == 6  # headers intact: the lookup cannot tell
    n, _ = _read(b, keys[:4])
    assert n == 0
    s = b.stats()
    assert s.num_corrupt == 4 and s.num_read_pages == 0
    assert b.exists(keys) == 0
    assert _store(b, keys, pages) == [True] * 6
    assert b.stats().num_written_pages == 4 and b.stats().num_skipped_writes == 2  # 4, 5 were not read yet
    n, out = _read(b, keys[:4])
    assert n == 4 and np.array_equal(out, pages[:4])


def test_a_torn_segment_tail_is_ignored_at_open_and_the_rest_serves(tmp_path: Path) -> None:
    b = FileBackend(FP, tmp_path)
    keys, pages = _keys(4), _pages(4)
    _store(b, keys, pages)
    b.close()
    (path,) = _segments(b)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5])  # a writer died in the middle of the last value
    again = FileBackend(FP, tmp_path)
    n, out = _read(again, keys)
    assert n == 3 and np.array_equal(out[:3], pages[:3])
    assert again.stats().num_corrupt == 0  # never indexed: not a hit to verify


def test_a_value_of_another_model_in_the_directory_is_never_served(tmp_path: Path) -> None:
    b = FileBackend(FP, tmp_path)
    keys, pages = _keys(2), _pages(2)
    _store(b, keys[:1], pages[:1])
    b.close()
    other = FileBackend(OTHER_FP, tmp_path)
    (path,) = _segments(b)
    path.rename(other.dir / path.name)  # another model's segment, misplaced
    assert _read(FileBackend(OTHER_FP, tmp_path), keys[:1])[0] == 0


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
    b = FileBackend(FP, tmp_path)  # a server started on the read-only store
    with caplog.at_level(logging.WARNING, logger="himamba.cache.storage"):
        assert _store(b, keys[2:], pages[2:]) == [False] * 4
        assert not b.set_state(keys[0], b"s")
    assert sum("fail" in r.getMessage() for r in caplog.records) == 1
    assert b.stats().num_refused_writes == 5
    n, out = _read(b, keys)  # what was stored still serves
    assert n == 2 and np.array_equal(out[:2], pages[:2])


def _chmod_read_only_refuses_writes(root: Path) -> None:
    b = FileBackend(FP, root)
    os.chmod(b.dir, 0o555)
    try:
        assert _store(b, _keys(2), _pages(2)) == [False, False]
    finally:
        os.chmod(b.dir, 0o755)


def _as_nobody(check: Callable[[Path], None]) -> None:
    """Run `check(dir)` in a forked child that has given up root, in a fresh directory it owns:
    root writes through directory modes, so the check would prove nothing as root. The child
    cannot import from root's home, so the caller runs the same code path once first."""
    top = Path(tempfile.mkdtemp(prefix="himamba-nobody-", dir="/tmp"))  # /tmp: reachable by nobody
    os.chown(top, _NOBODY, _NOBODY)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports by its exit status
            code = 1
            try:
                os.setgroups([])
                os.setgid(_NOBODY)
                os.setuid(_NOBODY)
                check(top)
                code = 0
            except BaseException:  # noqa: BLE001 - whatever fails, the child must exit with 1
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the check failed as nobody (traceback on stderr)"
    finally:
        shutil.rmtree(top)


def test_a_chmod_read_only_directory_refuses_writes(tmp_path: Path) -> None:
    # The same writes into a writable directory are stored (and, as root, import what the child needs).
    assert _store(FileBackend(FP, tmp_path / "writable"), _keys(2), _pages(2)) == [True, True]
    if os.geteuid() == 0:
        _as_nobody(_chmod_read_only_refuses_writes)
    else:
        _chmod_read_only_refuses_writes(tmp_path / "read-only")


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


def test_the_size_cap_evicts_least_recently_used_segments(tmp_path: Path) -> None:
    value = HEADER_BYTES + PAGE
    b = FileBackend(FP, tmp_path, max_bytes=5 * value, low_watermark=0.6, segment_bytes=value, touch_interval_s=0)
    keys, pages = _keys(10), _pages(10)
    for i in range(5):  # one value per segment, distinct old recencies: key 0 oldest
        assert _store(b, keys[i : i + 1], pages[i : i + 1]) == [True]
        os.utime(_record(b, keys[i])[0], (1_000_000 + i, 1_000_000 + i))
        b._index[(ValueKind.KV, keys[i])][0].mtime = 1_000_000 + i
    assert _read(b, keys[:1])[0] == 1  # a hit refreshes key 0
    assert _store(b, keys[5:6], pages[5:6]) == [True]
    s = b.stats()
    assert s.num_evicted == 3 and s.used_bytes <= 5 * value and s.capacity_bytes == 5 * value
    assert [b.exists(keys[i : i + 1]) for i in range(6)] == [1, 0, 0, 0, 1, 1]
    assert _store(b, keys[6:], pages[6:]) == [True] * 4
    assert sum(p.stat().st_size for p in _segments(b)) <= 5 * value
    # A restart counts what is on disk.
    assert FileBackend(FP, tmp_path, max_bytes=5 * value).stats().used_bytes == b.stats().used_bytes


def test_filling_far_past_a_small_cap_keeps_the_directory_under_it(tmp_path: Path) -> None:
    cap = 40 * (HEADER_BYTES + PAGE)
    b = FileBackend(FP, tmp_path, max_bytes=cap)
    for i in range(30):
        _store(b, _keys(8, salt=i), _pages(8, seed=i))
        assert sum(p.stat().st_size for p in _segments(b)) <= cap
    assert b.stats().num_evicted > 0
    assert _read(b, _keys(8, salt=29))[0] == 8  # the newest survive


def test_the_default_cap_is_a_fraction_of_the_free_space_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_cap(1_000_000_000) == int(1_000_000_000 * DEFAULT_CAP_FRACTION)
    assert default_cap(0) == 1
    import himamba.services.cache.storage.factory as factory

    monkeypatch.setattr(factory, "filesystem_free_bytes", lambda d: 50_000_000)
    b = open_backend("file", FP, directory=tmp_path)
    assert b is not None and b.stats().capacity_bytes == default_cap(50_000_000) > 0
    assert open_backend("file", FP, directory=tmp_path, max_bytes=123).stats().capacity_bytes == 123  # type: ignore[union-attr]


def test_two_instances_share_one_directory_read_each_other_and_respect_one_cap(tmp_path: Path) -> None:
    cap = 30 * (HEADER_BYTES + PAGE)
    a = FileBackend(FP, tmp_path, max_bytes=cap, rescan_s=0)
    b = FileBackend(FP, tmp_path, max_bytes=cap, rescan_s=0)
    ka, kb = _keys(4, salt=1), _keys(4, salt=2)
    _store(a, ka, _pages(4, 1))
    _store(b, kb, _pages(4, 2))
    assert a.exists(kb) == 4 and b.exists(ka) == 4  # live, without a restart
    n, out = _read(a, kb)
    assert n == 4 and np.array_equal(out, _pages(4, 2))
    for i in range(20):
        _store(a if i % 2 else b, _keys(4, salt=10 + i), _pages(4, 10 + i))
        assert sum(p.stat().st_size for p in _segments(a)) <= cap
    assert _read(a, _keys(4, salt=29))[0] == 4 and _read(b, _keys(4, salt=28))[0] == 4


def test_a_value_larger_than_the_cap_is_refused(tmp_path: Path) -> None:
    b = FileBackend(FP, tmp_path, max_bytes=PAGE)
    assert _store(b, _keys(1), _pages(1)) == [False]
    assert b.stats().num_refused_writes == 1


def test_default_directory_follows_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_storage_dir() == tmp_path / "himamba" / "storage"
    assert FileBackend(FP).dir == tmp_path / "himamba" / "storage" / FP.hex()


def _fds_under(directory: Path) -> int:
    """This process's open descriptors of files under `directory` (deleted ones included)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(str(directory))
    return n


def test_read_descriptors_are_kept_but_never_outlive_their_segment_or_the_backend(tmp_path: Path) -> None:
    b = FileBackend(FP, tmp_path)
    keys, pages = _keys(4), _pages(4)
    _store(b, keys, pages)
    assert _read(b, keys)[0] == 4
    assert _read(b, keys)[0] == 4
    assert _fds_under(tmp_path) == 2  # the writer's segment and one kept reader (not one per call)
    b._close_active()
    for seg in _segments(b):
        seg.unlink()  # evicted by another server
    b._rescan(force=True)
    assert _read(b, keys)[0] == 0
    assert _fds_under(tmp_path) == 0, "a descriptor kept a deleted segment's space"
    _store(b, keys, pages)
    assert _read(b, keys)[0] == 4
    b.close()
    assert _fds_under(tmp_path) == 0
