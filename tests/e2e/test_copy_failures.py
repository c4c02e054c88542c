"""Copy orders that fail on a real server (the worker's fault-injection hook): a load-back that
fails, a backup that fails, a batch that fails with copies attached. The request whose batch
failed gets an error; the server keeps serving, every later answer equals transformers' greedy
tokens, the cache invariants hold and every host pin is released."""

from __future__ import annotations

import pytest

from himamba.common.client import Client, HimambaError
from tests.e2e.prompts import random_tokens
from tests.worker.hf_reference import greedy

GEN = 6
# Device pools far smaller than the prompts together: early prompts are demoted to host and come
# back by load-back; no storage tier, so every host pin belongs to a device<->host copy.
FLAGS = (
    "--max-total-tokens", "512", "--max-mamba-cache-size", "12", "--max-context-len", "512",
    "--hicache-tokens", "16384", "--hicache-mamba-slots", "64", "--max-running-requests", "2",
    "--hicache-storage-backend", "none",
)
PROMPTS = [random_tokens(40, 500 + i) for i in range(14)]
FOLLOW_UPS = [PROMPTS[i] + random_tokens(8, 600 + i) for i in range(3)]

_expected: dict[tuple[int, ...], list[int]] = {}


def _want(ref, p: list[int]) -> list[int]:
    key = tuple(p)
    if key not in _expected:
        _expected[key] = greedy(ref, p, GEN)
    return _expected[key]


def _answer(c: Client, p: list[int]) -> list[int] | None:
    try:
        out = c.generate(input_ids=p, max_tokens=GEN, ignore_eos=True)
    except HimambaError:
        return None
    return None if out.finish_reason == "error" else out.token_ids


@pytest.mark.parametrize(
    "hook",
    [
        ("--debug-transfer-direction", "h2d", "--debug-transfer-fail-at", "1"),
        ("--debug-transfer-direction", "d2h", "--debug-transfer-fail-at", "2"),
        ("--debug-batch-fail-at-transfer", "3"),
    ],
    ids=["load_back_fails", "backup_fails", "batch_fails"],
)
def test_failed_copies_fail_their_batch_only_and_leak_nothing(server_factory, model_dir, ref, hook):
    s = server_factory(model_dir, *FLAGS, *hook)
    errors = 0
    with Client(s.endpoint) as c:
        for p in PROMPTS + FOLLOW_UPS:
            got = _answer(c, p)
            if got is None:
                errors += 1
            else:
                assert got == _want(ref, p)
        # Everything again, after the failure: every answer is right.
        for p in FOLLOW_UPS + PROMPTS[:4]:
            assert _answer(c, p) == _want(ref, p)
    st = s.cache_stats(check_invariants=True)
    assert st.invariants_ok, st.invariants_error
    assert st.running_requests == 0
    assert st.host_pages_protected == 0 and st.host_states_protected == 0, "a host pin leaked"
    if "--debug-transfer-fail-at" in hook:
        assert st.failed_transfers >= 1
    else:
        # The hook fired; its batch may have carried copies only (no request to fail), so errors may be 0.
        assert "debug.batch_fail_at_transfer" in s.log(), errors
    assert s.proc.poll() is None, "the server died"
