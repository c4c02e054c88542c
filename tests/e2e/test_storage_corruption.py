"""Corruption is a miss, never a stall (issue 15): every value in the store is corrupted while no
server runs; a restarted server answers every prompt correctly (recomputing), its prefetch keeps
trying on later requests, and once its backups have written the values again, storage hits resume
on that same server. Both the file backend (segments edited on disk) and Redis (values rewritten
in place) are driven."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest

from himamba.common.client import Client, Completion
from himamba.services.cache.storage.base import HEADER_BYTES
from tests.e2e.prompts import random_tokens
from tests.reliability.store_servers import wait_backups_settled, wait_metrics
from tests.system_packages import REDIS, skip_without
from tests.worker.hf_reference import greedy

GEN = 8
NUM_PROMPTS = 16  # 16 x 178 tokens: more than the device and host tiers below hold together
# Small device and host tiers, so a prompt sent again round-robin has left both and can only
# come back from storage; wait_complete: an admitted request waits for its whole prefetch.
SMALL_TIERS = (
    "--max-total-tokens", "1024", "--max-mamba-cache-size", "12", "--hicache-tokens", "1024",
    "--hicache-mamba-slots", "12", "--max-running-requests", "4", "--max-context-len", "512",
    "--prefetch-threshold", "32", "--hicache-storage-prefetch-policy", "wait_complete",
    "--prefetch-timeout-max-s", "20",
)  # fmt: skip
_PAYLOAD_BYTES_AT = 12  # in the value header (base.py): magic 4, version 2, kind 1, flags 1, tokens 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _corrupt_segments(store: Path) -> int:
    """Flip one payload byte of every value in every segment file; returns how many."""
    n = 0
    for seg in store.rglob("*.seg"):
        data = bytearray(seg.read_bytes())
        off = 0
        while off + HEADER_BYTES <= len(data):
            (nbytes,) = struct.unpack_from("<Q", data, off + _PAYLOAD_BYTES_AT)
            data[off + HEADER_BYTES + nbytes // 2] ^= 0x5A
            off += HEADER_BYTES + nbytes
            n += 1
        assert off == len(data), f"{seg}: not a whole number of values"
        seg.write_bytes(bytes(data))
    return n


def _corrupt_redis(url: str) -> int:
    """Flip one payload byte of every value Redis holds; returns how many."""
    import redis

    r = redis.Redis.from_url(url)
    n = 0
    for name in r.scan_iter(match=b"himamba:*"):
        value = bytearray(r.get(name))
        value[HEADER_BYTES + (len(value) - HEADER_BYTES) // 2] ^= 0x5A
        r.set(name, bytes(value))
        n += 1
    r.close()
    return n


def _round(endpoint: str, prompts: list[list[int]]) -> list[Completion]:
    """The prompts one after another (concurrent prefetches would compete for the small host
    tier, which is not what this test is about)."""
    with Client(endpoint, timeout_s=180) as c:
        return [c.generate(input_ids=p, max_tokens=GEN, ignore_eos=True) for p in prompts]


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_after_every_value_is_corrupted_prefetch_keeps_trying_and_hits_resume(
    kind, server_factory, model_dir, ref, tmp_path
):
    prompts = [random_tokens(170, 900 + i) for i in range(NUM_PROMPTS)]
    want = [greedy(ref, p, GEN) for p in prompts]
    store_dir = tmp_path / "store"
    redis_store = None
    if kind == "file":
        store_flags: tuple[str, ...] = ("--hicache-storage-backend", "file", "--hicache-storage-dir", str(store_dir))
    else:
        from himamba.services.cache.storage.local_stores import LocalRedis

        skip_without(REDIS)
        redis_store = LocalRedis(tmp_path / "redis", maxmemory_bytes=256 << 20).start()
        store_flags = ("--hicache-storage-backend", "redis", "--hicache-storage-url", redis_store.url)
    try:
        # Stored by a first server.
        port = _free_port()
        s = server_factory(model_dir, *SMALL_TIERS, *store_flags, "--port", str(port))
        outs = _round(s.endpoint, prompts)
        assert [o.token_ids for o in outs] == want
        wait_backups_settled(port)
        s.stop()

        # Every value corrupted while no server runs.
        num_bad = _corrupt_segments(store_dir) if redis_store is None else _corrupt_redis(redis_store.url)
        assert num_bad >= NUM_PROMPTS * 2, num_bad

        port = _free_port()
        s = server_factory(model_dir, *SMALL_TIERS, *store_flags, "--port", str(port))
        outs = _round(s.endpoint, prompts)
        assert [o.token_ids for o in outs] == want  # recomputed: correct
        assert sum(o.usage.cached_tokens.storage for o in outs) == 0  # nothing corrupt served
        wait_metrics(port, lambda m: m.events.get("corrupt", 0) > 0, "corrupt values counted")

        # The same prompts again, round-robin (each left the device and host tiers since): the
        # prefetch keeps trying, the backups of the recomputed prefixes write the values again,
        # and storage hits come back. Bounded: a prefetch that meets a corrupt value has the rest of
        # its batch checked too, and each round heals at least a batch per prompt (here: 3 rounds).
        hits: list[int] = []
        for _ in range(4):
            wait_backups_settled(port)
            outs = _round(s.endpoint, prompts)
            assert [o.token_ids for o in outs] == want
            hits.append(sum(1 for o in outs if o.usage.cached_tokens.storage >= 32))
            if hits[-1] == NUM_PROMPTS:
                break
        assert hits[-1] == NUM_PROMPTS, f"prompts with a storage hit, per round: {hits}"
        st = s.cache_stats(check_invariants=True)
        assert st.invariants_ok, st.invariants_error
        assert s.proc.poll() is None
    finally:
        if redis_store is not None:
            redis_store.stop()
