"""A himamba server on a distributed store (Redis or Mooncake) for the outage and full-store tests:
the store processes, the flags that point a server at them, conversations whose later turns must
come back from the store, and the storage series of the server's /metrics."""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

from prometheus_client.parser import text_string_to_metric_families

from himamba.common.client import AsyncClient, Completion
from himamba.services.cache.storage.local_stores import LocalMooncake, LocalRedis
from tests.reliability.prompts import MAX_CONTEXT_LEN, Prompt, random_ids
from tests.system_packages import REDIS, skip_without, skip_without_mooncake

# Device and host tiers far smaller than the conversations, so that later turns need the store;
# wait_complete: an admitted request waits for its prefetch, so a stored prefix is always a hit.
SMALL_TIERS = (
    "--max-total-tokens", "1024", "--max-mamba-cache-size", "12", "--hicache-tokens", "1024",
    "--hicache-mamba-slots", "12", "--max-running-requests", "4", "--prefetch-threshold", "32",
    "--hicache-storage-prefetch-policy", "wait_complete", "--prefetch-timeout-max-s", "20",
    "--max-context-len", str(MAX_CONTEXT_LEN),
)  # fmt: skip
STORE_KINDS = ("redis", "mooncake")


def start_store(
    kind: str, workdir: Path, *, small: bool = False
) -> tuple[LocalRedis | LocalMooncake, tuple[str, ...]]:
    """Start a local store of `kind` (skip the test when it is not installed); returns it and the
    server flags that point at it. `small`: a store that fills up (Redis refuses writes when
    full; Mooncake has its smallest segment and evicts)."""
    __tracebackhide__ = True  # a skip is reported at the test's line
    if kind == "redis":
        skip_without(REDIS)
        redis = LocalRedis(workdir, maxmemory_bytes=(2 << 20) if small else (256 << 20),
                           policy="noeviction" if small else "allkeys-lru").start()  # fmt: skip
        return redis, ("--hicache-storage-backend", "redis", "--hicache-storage-url", redis.url)
    skip_without_mooncake()
    mooncake = LocalMooncake(workdir, segment_bytes=(16 << 20) if small else (256 << 20)).start()
    flags = (
        "--hicache-storage-backend", "mooncake", "--hicache-storage-url", mooncake.master_address,
        "--mooncake-metadata-server", mooncake.metadata_server,
    )  # fmt: skip
    return mooncake, flags


def kill_store(store: LocalRedis | LocalMooncake) -> None:
    """SIGKILL the whole store: for Mooncake the master and the process owning the memory."""
    if isinstance(store, LocalMooncake):
        store.kill_segment_owner()
        store.kill_master()
    else:
        store.kill()


class Conversations:
    """`n` seeded conversations that grow by `each` random tokens plus the model's answer a turn."""

    def __init__(
        self, n: int, seed: int, first: int = 160, each: int = 32, max_tokens: int = 8
    ) -> None:
        self.rng = random.Random(seed)
        self.each = each
        self.max_tokens = max_tokens
        self.history = [random_ids(first, self.rng) for _ in range(n)]

    def turn(self) -> list[Prompt]:
        return [Prompt(list(h), self.max_tokens) for h in self.history]

    def answered(self, outs: list[Completion]) -> None:
        self.history = [
            h + o.token_ids + random_ids(self.each, self.rng)
            for h, o in zip(self.history, outs, strict=True)
        ]


async def run_prompts(endpoint: str, prompts: list[Prompt]) -> list[Completion]:
    async with AsyncClient(endpoint, timeout_s=180) as c:
        return list(
            await asyncio.gather(
                *(
                    c.generate(
                        input_ids=p.input_ids, max_tokens=p.max_tokens, ignore_eos=True
                    )
                    for p in prompts
                )
            )
        )


def storage_hits(outs: list[Completion]) -> int:
    return sum(o.usage.cached_tokens.storage for o in outs)


class StorageSeries(NamedTuple):
    """The server's storage series at one scrape."""

    up: float
    events: dict[str, float]  # himamba_cache_storage_events_total by event
    errors: dict[str, float]  # himamba_cache_storage_errors_total by op
    backup_ops: float
    backup_bytes: dict[str, float]  # to storage, by kind (kv, mamba)


def scrape_storage(port: int) -> StorageSeries:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    up, backup_ops = 0.0, 0.0
    events: dict[str, float] = {}
    errors: dict[str, float] = {}
    backup_bytes: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "himamba_cache_storage_up":
                up = s.value
            elif s.name == "himamba_cache_storage_events_total":
                events[s.labels["event"]] = s.value
            elif s.name == "himamba_cache_storage_errors_total":
                errors[s.labels["op"]] = s.value
            elif s.name == "himamba_cache_backup_ops_total" and s.labels.get("tier") == "storage":
                backup_ops = s.value
            elif s.name == "himamba_cache_backup_bytes_total" and s.labels.get("tier") == "storage":
                backup_bytes[s.labels["kind"]] = s.value
    return StorageSeries(up, events, errors, backup_ops, backup_bytes)


def wait_metrics(port: int, ok, what: str, timeout_s: float = 60.0) -> StorageSeries:  # type: ignore[no-untyped-def]
    """Scrape until `ok(series)` (services report every few seconds); fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while True:
        series = scrape_storage(port)
        if ok(series):
            return series
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what}: not seen in {timeout_s:.0f} s; last scrape {series}"
            )
        time.sleep(0.5)


def wait_backups_settled(
    port: int, quiet_s: float = 2.0, timeout_s: float = 60.0
) -> None:
    """Until the storage backup count has not moved for `quiet_s` (backups are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    last, since = -1.0, time.monotonic()
    while time.monotonic() < deadline:
        ops = scrape_storage(port).backup_ops
        if ops != last:
            last, since = ops, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.5)
