"""The mooncake backend against a real Mooncake Store (mooncake_master + a mooncake_client owning
the memory; himamba a pure client): the contract, a full pool, a master outage and its recovery,
a store that starts after us, and sharing between servers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from himamba.bench.storage_bandwidth import measure_storage_bandwidth
from himamba.common.config import CacheConfig
from himamba.services.cache.storage.base import ValueKind
from himamba.services.cache.storage.factory import open_backend, open_configured_backend
from himamba.services.cache.storage.local_stores import LocalMooncake
from himamba.services.cache.storage.mooncake import MooncakeBackend, default_metadata_server
from tests.cache.storage import remote_checks as rc

FAST = {"backoff_base_s": 0.05, "backoff_max_s": 0.3}


def _open(store: LocalMooncake, **kw: Any) -> MooncakeBackend:
    return MooncakeBackend(rc.FP, store.master_address, metadata_server=store.metadata_server, **{**FAST, **kw})


@pytest.fixture(scope="module")
def store(mooncake_factory: Callable[..., LocalMooncake]) -> LocalMooncake:
    return mooncake_factory(segment_bytes=128 << 20)


@pytest.fixture(scope="module")
def backend(store: LocalMooncake) -> Iterator[MooncakeBackend]:
    b = _open(store)
    assert b.connected
    yield b
    b.close()


@pytest.fixture(scope="module")
def raw_client(store: LocalMooncake) -> Iterator[Any]:
    """A plain Mooncake client (another program sharing the store)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", store.metadata_server, 0, 16 << 20, "tcp", "", store.master_address) == 0
    yield client
    client.close()


def _name(key: bytes, kind: ValueKind) -> str:
    return f"himamba:{key.hex()}:{'kv' if kind is ValueKind.KV else 'st'}"


def test_round_trip(backend: MooncakeBackend) -> None:
    rc.check_round_trip(backend)


def test_exists_is_a_prefix_and_hits_end_at_a_state(backend: MooncakeBackend) -> None:
    rc.check_prefix_semantics(backend)


def test_values_written_by_others_are_misses(backend: MooncakeBackend, raw_client: Any) -> None:
    def write_raw(name: str, value: bytes) -> None:
        assert raw_client.put(name, value) == 0

    rc.check_verification(backend, write_raw, _name)


def test_a_corrupt_value_makes_the_read_drop_every_bad_value_of_its_batch(
    backend: MooncakeBackend, raw_client: Any
) -> None:
    from himamba.services.cache.storage.base import ValueCodec

    ks = [bytes([7, i]) * 16 for i in range(4)]
    data = rc.pages(4, seed=13)
    codec = ValueCodec(rc.FP)
    for k, row in zip(ks, data):
        bad = row.copy()
        bad[3] ^= 0x01
        assert raw_client.put(_name(k, ValueKind.KV), codec.header(ValueKind.KV, k, row) + bad.tobytes()) == 0
    before = backend.stats().num_corrupt
    assert rc.read(backend, ks)[0] == 0
    assert backend.stats().num_corrupt - before == 4  # every bad value of the batch found (and removed when not leased)


def test_a_full_pool_refuses_or_evicts_and_never_returns_wrong_bytes(
    mooncake_factory: Callable[..., LocalMooncake],
) -> None:
    small = mooncake_factory(segment_bytes=16 << 20, lease_ttl_ms=100)  # the smallest segment it takes
    b = _open(small)
    acked, readable = rc.check_full_store(b, num_pages=384, nbytes=128 << 10)  # 48 MiB into 16 MiB
    s = b.stats()
    assert acked < 384 or readable < 384
    assert s.num_refused_writes == 384 - acked  # -200 (no space): refused and counted, never an error
    assert s.num_errors == 0
    assert readable <= acked
    b.close()


def test_a_master_outage_fails_fast_and_the_backend_recovers_without_reopening(
    mooncake_factory: Callable[..., LocalMooncake],
) -> None:
    store = mooncake_factory(segment_bytes=16 << 20)
    b = _open(store)
    ks, data = rc.keys(3), rc.pages(3)
    assert rc.store(b, ks, data) == [True] * 3
    store.kill_master()
    rc.check_outage_calls(b, ks)
    assert b.link.gate.state().consecutive_failures >= 1
    store.start()  # a new master on the same address; the segment owner mounts its memory again
    rc.wait_until_served(b)
    assert b.stats().num_reconnects >= 1
    assert not b.link.gate.state().is_open
    b.close()


def test_losing_the_memory_owner_gives_misses_and_refusals_until_it_returns(
    mooncake_factory: Callable[..., LocalMooncake],
) -> None:
    store = mooncake_factory(segment_bytes=16 << 20, client_ttl_s=2)
    b = _open(store)
    ks, data = rc.keys(3), rc.pages(3)
    assert rc.store(b, ks, data) == [True] * 3
    store.kill_segment_owner()
    for _ in range(3):  # nothing raises; whatever is read is what was written
        n, out = rc.read(b, ks)
        assert np.array_equal(out[:n], data[:n])
        assert rc.store(b, rc.keys(2), rc.pages(2)) == [False, False]
    assert b.stats().num_corrupt == 0
    store.start()  # a new segment owner; the master forgets the dead one after client_ttl
    rc.wait_until_served(b)
    b.close()


def test_a_store_that_starts_after_us_is_used_once_it_is_up(mooncake_factory: Callable[..., LocalMooncake]) -> None:
    store = mooncake_factory(segment_bytes=16 << 20, run=False)
    b = _open(store, connect_wait_s=0.2)
    assert not b.connected
    ks = rc.keys(2)
    assert b.exists(ks) == 0 and rc.store(b, ks, rc.pages(2)) == [False, False]
    assert b.stats().num_errors == 2
    store.start()
    rc.wait_until_served(b)
    assert b.connected
    b.close()


def test_two_servers_share_one_store(backend: MooncakeBackend, store: LocalMooncake) -> None:
    other = _open(store)
    rc.check_sharing(backend, other)
    other.close()
    rc.check_other_process_reads(
        "from himamba.services.cache.storage.mooncake import MooncakeBackend\n"
        f"b = MooncakeBackend(bytes(range(32)), {store.master_address!r}, metadata_server={store.metadata_server!r})",
        backend,
    )


def test_concurrent_calls_on_one_backend(backend: MooncakeBackend) -> None:
    # Shared pages are stored first: a page another writer is still putting already "exists" but
    # reads as not ready (-703, a miss), so only own pages are written concurrently.
    shared_keys, shared = rc.keys(8), rc.pages(8, seed=11)
    assert rc.store(backend, shared_keys, shared) == [True] * 8
    failures: list[str] = []

    def worker(seed: int) -> None:
        own_keys, own = rc.keys(8), rc.pages(8, seed=seed)
        for round_ in range(5):
            if rc.store(backend, own_keys, own) != [True] * 8:
                failures.append(f"round {round_}: write refused")
            for ks, data in ((own_keys, own), (shared_keys, shared)):
                n, out = rc.read(backend, ks)
                if n != 8 or not np.array_equal(out, data):
                    failures.append(f"round {round_}: read {n} pages")

    before = backend.stats()
    threads = [threading.Thread(target=worker, args=(20 + i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    s = backend.stats()
    assert (s.num_corrupt, s.num_errors, s.num_misses) == (before.num_corrupt, before.num_errors, before.num_misses)
    assert s.num_written_pages - before.num_written_pages == 32


def test_closed_backend_refuses_calls(store: LocalMooncake) -> None:
    b = _open(store)
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.exists(rc.keys(1))


def test_factory_opens_mooncake_by_name_and_from_config(store: LocalMooncake) -> None:
    b = open_backend("mooncake", rc.FP, url=store.master_address, mooncake_metadata_server=store.metadata_server)
    assert isinstance(b, MooncakeBackend) and b.protocol == "tcp"
    rc.check_sharing(b, b)
    b.close()
    cfg = CacheConfig(
        hicache_storage_backend="mooncake",
        hicache_storage_url=store.master_address,
        mooncake_metadata_server=store.metadata_server,
    )
    b = open_configured_backend(cfg, rc.FP)
    assert isinstance(b, MooncakeBackend) and b.master_address == store.master_address
    b.close()
    with pytest.raises(ValueError, match="hicache_storage_url"):
        open_backend("mooncake", rc.FP, url="redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="mooncake_protocol"):
        MooncakeBackend(rc.FP, store.master_address, protocol="udp")  # type: ignore[arg-type]
    assert default_metadata_server("10.1.2.3:50051") == "http://10.1.2.3:8080/metadata"


def test_bandwidth_probe_moves_every_page(backend: MooncakeBackend) -> None:
    out = measure_storage_bandwidth(backend, page_bytes=64 << 10, n_pages=32)
    assert out["pages_written"] == out["pages_read"] == 32
    assert out["write_mb_s"] > 0 and out["read_mb_s"] > 0


class _ScriptedStore:
    """A stand-in client whose puts and gets answer scripted Mooncake codes."""

    def __init__(self, put_codes: list[int], get_codes: list[int], size: int) -> None:
        self.put_codes, self.get_codes, self.size = put_codes, get_codes, size
        self.removed: list[str] = []

    def setup(self, *args: Any) -> int:
        return 0

    def batch_is_exist(self, names: list[str]) -> list[int]:
        return [0] * len(names)

    def batch_put_from_multi_buffers(self, names: list[str], ptrs: Any, sizes: Any) -> list[int]:
        return self.put_codes[: len(names)]

    def batch_get_into_multi_buffers(self, names: list[str], ptrs: Any, sizes: Any) -> list[int]:
        return [self.get_codes.pop(0) for _ in names]

    def get_size(self, name: str) -> int:
        return self.size

    def remove(self, name: str) -> int:
        self.removed.append(name)
        return -706  # leased: refused, as a real store often does

    def close(self) -> int:
        return 0


def test_store_answers_map_to_acknowledged_refused_missing_and_corrupt() -> None:
    import socket

    with socket.socket() as listener:  # the backend checks that the master accepts connections
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        expected = rc.PAGE + 96
        fake = _ScriptedStore(
            put_codes=[0, -705, -200, -1700, -900],
            get_codes=[-600, -800, -704, expected - 10],
            size=expected - 10,
        )
        b = MooncakeBackend(
            rc.FP, address, metadata_server=f"http://{address}/metadata", client_factory=lambda: fake, **FAST
        )
        assert b.connected
        assert rc.store(b, rc.keys(5), rc.pages(5)) == [True, True, False, False, False]
        s = b.stats()
        assert (s.num_written_pages, s.num_skipped_writes, s.num_refused_writes, s.num_errors) == (1, 1, 2, 1)
        assert b.link.gate.state().is_open  # -900: the master is away
        b.link.gate.succeeded()
        for _ in range(4):
            assert rc.read(b, rc.keys(1))[0] == 0
        s = b.stats()
        # -600 (a larger object), -800 with another size and a short read are corrupt; -704 a miss.
        assert s.num_corrupt == 3 and s.num_misses == 1
        assert len(fake.removed) == 3
        fake.get_codes = [-704, -600]
        assert rc.read(b, rc.keys(2))[0] == 0
        assert (b.stats().num_misses, b.stats().num_corrupt) == (2, 3)  # nothing past the first miss
        b.close()
