"""Every architecture family through a running server: device and host prefix-cache hits give
exactly transformers' greedy tokens."""

from __future__ import annotations

import pytest

from himamba.bench.servers import start_server
from himamba.common.client import Client
from himamba.services.modelgen.checkpoint import make_checkpoint
from tests.e2e.prompts import random_tokens
from tests.worker.hf_reference import greedy, load_reference

FAMILIES = ["granite_hybrid", "bamba", "falcon_h1", "qwen3_next", "mamba2", "zamba2", "lfm2", "jamba"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_device_and_host_hits_match_transformers(arch, tmp_path):
    model_dir = make_checkpoint(arch, tmp_path / arch, preset="tiny")
    ref = load_reference(model_dir)
    # One server at a time (stopped at the end of each case): eight at once would not fit in memory.
    server = start_server(
        model_dir, tmp_path / "logs", "--max-total-tokens", "512", "--max-context-len", "512",
        "--max-mamba-cache-size", "12", "--hicache-tokens", "8192", "--hicache-mamba-slots", "32",
        "--max-running-requests", "2", "--mamba-track-interval", "16",
    )
    try:
        _check(server, ref)
    finally:
        server.stop()


def _check(server, ref) -> None:
    with Client(server.endpoint) as c:
        history = random_tokens(50, 1, vocab=2000)
        first = c.generate(input_ids=history, max_tokens=10, ignore_eos=True)
        assert first.token_ids == greedy(ref, history, 10)
        history = history + first.token_ids + random_tokens(30, 2, vocab=2000)
        second = c.generate(input_ids=history, max_tokens=10, ignore_eos=True)
        assert second.token_ids == greedy(ref, history, 10)
        assert second.usage.cached_tokens.device > 0
        for k in range(3):  # push the conversation out of the small device pool
            c.generate(input_ids=random_tokens(150, 10 + k, vocab=2000), max_tokens=2, ignore_eos=True)
        history = history + second.token_ids + random_tokens(20, 3, vocab=2000)
        third = c.generate(input_ids=history, max_tokens=10, ignore_eos=True)
        assert third.token_ids == greedy(ref, history, 10)
        assert third.usage.cached_tokens.host > 0
    stats = server.cache_stats()
    assert stats.invariants_ok, stats.invariants_error
    assert stats.running_requests == 0
