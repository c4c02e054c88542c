"""The redis backend against a real redis-server: the contract, a full server under both eviction
policies, an outage and its recovery, and sharing between servers."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

from himamba.bench.storage_bandwidth import measure_storage_bandwidth
from himamba.common.config import CacheConfig
from himamba.services.cache.storage.base import ValueKind
from himamba.services.cache.storage.factory import open_backend, open_configured_backend
from himamba.services.cache.storage.local_stores import LocalRedis
from himamba.services.cache.storage.redis_backend import RedisBackend
from tests.cache.storage import remote_checks as rc


@pytest.fixture(scope="module")
def server(redis_factory: Callable[..., LocalRedis]) -> LocalRedis:
    return redis_factory(maxmemory_bytes=256 << 20)


@pytest.fixture
def backend(server: LocalRedis) -> Iterator[RedisBackend]:
    b = RedisBackend(rc.FP, server.url, backoff_base_s=0.05, backoff_max_s=0.2)
    yield b
    b.close()


def _name(key: bytes, kind: ValueKind) -> str:
    return f"himamba:{key.hex()}:{'kv' if kind is ValueKind.KV else 'st'}"


def test_round_trip(backend: RedisBackend) -> None:
    rc.check_round_trip(backend)


def test_exists_is_a_prefix_and_hits_end_at_a_state(backend: RedisBackend) -> None:
    rc.check_prefix_semantics(backend)


def test_values_written_by_others_are_misses_and_are_replaced(backend: RedisBackend, server: LocalRedis) -> None:
    raw = redis.Redis.from_url(server.url)
    rc.check_verification(backend, lambda name, value: raw.set(name, value), _name)
    # The bad value was deleted, so the page can be stored and read again.
    k, data = rc.keys(1), rc.pages(1, seed=9)
    raw.set(_name(k[0], ValueKind.KV), b"junk")
    assert rc.read(backend, k)[0] == 0
    assert raw.get(_name(k[0], ValueKind.KV)) is None
    assert rc.store(backend, k, data) == [True]
    n, out = rc.read(backend, k)
    assert n == 1 and np.array_equal(out, data)
    # A key of another type (a list someone pushed) is a miss too, not an exception.
    k2 = rc.keys(1)
    raw.rpush(_name(k2[0], ValueKind.KV), b"x")
    assert rc.read(backend, k2)[0] == 0


def test_a_corrupt_value_makes_the_read_delete_every_bad_value_of_its_batch(
    backend: RedisBackend, server: LocalRedis
) -> None:
    raw = redis.Redis.from_url(server.url)
    ks, data = rc.keys(5), rc.pages(5, seed=11)
    assert rc.store(backend, ks, data) == [True] * 5
    for k in ks[:4]:  # every value but the last damaged
        name = _name(k, ValueKind.KV)
        value = bytearray(raw.get(name))
        value[-7] ^= 0x01
        raw.set(name, bytes(value))
    before = backend.stats().num_corrupt
    assert rc.read(backend, ks)[0] == 0
    assert backend.stats().num_corrupt - before == 4
    assert [raw.exists(_name(k, ValueKind.KV)) for k in ks] == [0, 0, 0, 0, 1]  # all four gone, the good one kept
    assert rc.store(backend, ks, data) == [True] * 5  # one backup replaces them all
    n, out = rc.read(backend, ks)
    assert n == 5 and np.array_equal(out, data)


def test_a_full_lru_server_evicts_and_never_returns_wrong_bytes(redis_factory: Callable[..., LocalRedis]) -> None:
    small = redis_factory(maxmemory_bytes=2 << 20, policy="allkeys-lru")
    b = RedisBackend(rc.FP, small.url)
    acked, readable = rc.check_full_store(b, num_pages=96, nbytes=64 << 10)  # 6 MiB into 2 MiB
    assert acked == 96  # the server makes room by itself
    assert 0 < readable < 96
    assert b.exists(rc.keys(1)) == 0
    b.close()


def test_a_full_noeviction_server_refuses_writes_and_counts_them(redis_factory: Callable[..., LocalRedis]) -> None:
    small = redis_factory(maxmemory_bytes=2 << 20, policy="noeviction")
    b = RedisBackend(rc.FP, small.url)
    acked, readable = rc.check_full_store(b, num_pages=96, nbytes=64 << 10)
    s = b.stats()
    assert 0 < acked < 96 and readable == acked
    assert s.num_refused_writes == 96 - acked
    assert s.num_errors == 0  # a full store is not an unreachable one
    b.close()


def test_an_outage_fails_fast_and_the_backend_recovers_without_reopening(
    redis_factory: Callable[..., LocalRedis],
) -> None:
    server = redis_factory()
    b = RedisBackend(rc.FP, server.url, backoff_base_s=0.05, backoff_max_s=0.2)
    ks, data = rc.keys(3), rc.pages(3)
    assert rc.store(b, ks, data) == [True] * 3
    server.kill()
    rc.check_outage_calls(b, ks)
    assert b.link.gate.state().consecutive_failures >= 1
    server.start()  # same port, empty (no persistence)
    rc.wait_until_served(b)
    s = b.stats()
    assert s.num_reconnects >= 1
    assert not b.link.gate.state().is_open
    assert b.exists(ks) == 0  # what was stored went with the old process
    b.close()


def test_while_away_calls_are_refused_without_reaching_the_server(redis_factory: Callable[..., LocalRedis]) -> None:
    server = redis_factory()
    b = RedisBackend(rc.FP, server.url, backoff_base_s=60.0, backoff_max_s=60.0)
    server.kill()
    ks = rc.keys(2)
    assert b.exists(ks) == 0  # the call that finds the server gone
    assert b.link.gate.state().is_open
    server.start()
    # The server is back, but the backoff has not passed: calls still fail fast, never reaching it.
    assert b.exists(ks) == 0 and rc.store(b, ks, rc.pages(2)) == [False, False]
    assert b.stats().num_errors == 3
    assert redis.Redis.from_url(server.url).dbsize() == 0
    b.close()


def test_two_servers_share_one_redis(backend: RedisBackend, server: LocalRedis) -> None:
    other = RedisBackend(rc.FP, server.url)
    rc.check_sharing(backend, other)
    other.close()
    rc.check_other_process_reads(
        f"from himamba.services.cache.storage.redis_backend import RedisBackend\nb = RedisBackend(bytes(range(32)), {server.url!r})",
        backend,
    )


def test_closed_backend_refuses_calls(server: LocalRedis) -> None:
    b = RedisBackend(rc.FP, server.url)
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.exists(rc.keys(1))


def test_factory_opens_redis_by_name_and_from_config(server: LocalRedis) -> None:
    b = open_backend("redis", rc.FP, url=server.url)
    assert isinstance(b, RedisBackend)
    rc.check_sharing(b, b)
    b.close()
    cfg = CacheConfig(hicache_storage_backend="redis", hicache_storage_url=server.url)
    b = open_configured_backend(cfg, rc.FP)
    assert isinstance(b, RedisBackend) and b.url == server.url
    b.close()
    with pytest.raises(ValueError, match="hicache_storage_url"):
        open_backend("redis", rc.FP, url="http://127.0.0.1:6379")


def test_bandwidth_probe_moves_every_page(backend: RedisBackend) -> None:
    out = measure_storage_bandwidth(backend, page_bytes=64 << 10, n_pages=32)
    assert out["pages_written"] == out["pages_read"] == 32
    assert out["write_mb_s"] > 0 and out["read_mb_s"] > 0
