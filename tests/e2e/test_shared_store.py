"""Two himamba servers share one distributed store: a prefix computed on server A is a storage
hit on server B, with exactly transformers' greedy tokens (Redis and Mooncake Store)."""

from __future__ import annotations

import time

import pytest

from himamba.common.client import Client
from himamba.services.cache.storage.local_stores import LocalMooncake, LocalRedis
from tests.e2e.prompts import random_tokens
from tests.e2e.storage_flags import STORAGE_FLAGS
from tests.system_packages import REDIS, skip_without, skip_without_mooncake
from tests.worker.hf_reference import greedy

GEN = 8


def _store_flags(kind: str, tmp_path):
    __tracebackhide__ = True  # a skip is reported at the test's line
    if kind == "redis":
        skip_without(REDIS)
        store = LocalRedis(tmp_path / "redis").start()
        return store, ("--hicache-storage-backend", "redis", "--hicache-storage-url", store.url)
    skip_without_mooncake()
    store = LocalMooncake(tmp_path / "mooncake", segment_bytes=256 << 20).start()
    return store, (
        "--hicache-storage-backend", "mooncake", "--hicache-storage-url", store.master_address,
        "--mooncake-metadata-server", store.metadata_server,
    )


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_prefix_computed_on_a_is_a_storage_hit_on_b(kind, server_factory, model_dir, ref, tmp_path):
    store, flags = _store_flags(kind, tmp_path)
    try:
        a = server_factory(model_dir, *STORAGE_FLAGS, *flags)
        b = server_factory(model_dir, *STORAGE_FLAGS, *flags)
        history = random_tokens(100, 1)
        with Client(a.endpoint) as ca:
            out = ca.generate(input_ids=history, max_tokens=GEN, ignore_eos=True)
            assert out.token_ids == greedy(ref, history, GEN)
        time.sleep(3.0)  # backups to the store are asynchronous
        nxt = history + out.token_ids + random_tokens(20, 2)
        with Client(b.endpoint) as cb:
            got = cb.generate(input_ids=nxt, max_tokens=GEN, ignore_eos=True)
        assert got.token_ids == greedy(ref, nxt, GEN)
        assert got.usage.cached_tokens.storage >= 64, got.usage
        for s in (a, b):
            st = s.cache_stats(check_invariants=True)
            assert st.invariants_ok, st.invariants_error
    finally:
        store.stop()
