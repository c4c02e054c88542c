"""Two himamba servers share one distributed store: a prefix computed on server A is a storage
hit on server B, with exactly transformers' greedy tokens (Redis and Mooncake Store)."""

from __future__ import annotations

import random
import time

import pytest

from himamba.common.client import Client
from himamba.services.cache.storage.local_stores import LocalMooncake, LocalRedis
from himamba.services.modelgen.checkpoint import make_checkpoint
from tests.worker.hf_reference import greedy, load_reference

GEN = 8
COMMON = (
    "--max-total-tokens", "4096", "--max-mamba-cache-size", "32", "--max-context-len", "512",
    "--prefetch-threshold", "32", "--hicache-storage-prefetch-policy", "wait_complete",
    "--prefetch-timeout-max-s", "20",
)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 2048) for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_checkpoint("nemotron_h", tmp_path_factory.mktemp("m"), preset="tiny")


@pytest.fixture(scope="module")
def ref(model_dir):
    return load_reference(model_dir)


def _store_flags(kind: str, tmp_path):
    if kind == "redis":
        try:
            store = LocalRedis(tmp_path / "redis").start()
        except FileNotFoundError as e:
            pytest.skip(str(e))
        return store, ("--hicache-storage-backend", "redis", "--hicache-storage-url", store.url)
    try:
        store = LocalMooncake(tmp_path / "mooncake", segment_bytes=256 << 20).start()
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(str(e))
    return store, (
        "--hicache-storage-backend", "mooncake", "--hicache-storage-url", store.master_address,
        "--mooncake-metadata-server", store.metadata_server,
    )


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_prefix_computed_on_a_is_a_storage_hit_on_b(kind, server_factory, model_dir, ref, tmp_path):
    store, flags = _store_flags(kind, tmp_path)
    try:
        a = server_factory(model_dir, *COMMON, *flags)
        b = server_factory(model_dir, *COMMON, *flags)
        history = _tokens(100, 1)
        with Client(a.endpoint) as ca:
            out = ca.generate(input_ids=history, max_tokens=GEN, ignore_eos=True)
            assert out.token_ids == greedy(ref, history, GEN)
        time.sleep(3.0)  # backups to the store are asynchronous
        nxt = history + out.token_ids + _tokens(20, 2)
        with Client(b.endpoint) as cb:
            got = cb.generate(input_ids=nxt, max_tokens=GEN, ignore_eos=True)
        assert got.token_ids == greedy(ref, nxt, GEN)
        assert got.usage.cached_tokens.storage >= 64, got.usage
        for s in (a, b):
            st = s.cache_stats(check_invariants=True)
            assert st.invariants_ok, st.invariants_error
    finally:
        store.stop()
