"""A server with the file storage tier asked for (its default directory and cap) reports the storage tier
as up, with a non-zero capacity, and its use once something is backed up."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

REPORT_INTERVAL_S = 0.5


@pytest.fixture(scope="module")
def default_live(tmp_path_factory: pytest.TempPathFactory, start_live_server_fn: Any, demo_checkpoint: Any) -> Iterator[Any]:
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))  # the default directory, kept apart
    server = start_live_server_fn(
        demo_checkpoint, tmp_path_factory.mktemp("logs"), "--report-interval-s", str(REPORT_INTERVAL_S),
        "--hicache-storage-backend", "file", "--hicache-storage-dir", "",
    )
    try:
        yield server
    finally:
        server.stop()
        mp.undo()


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of the series `name` with these labels (others, like model_name, may be there too);
    NaN while it is not exported yet (its first report may be late)."""
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
            return float(value)
    return float("nan")


def test_a_file_tier_server_reports_storage_up_with_its_capacity_and_use(default_live: Any):
    default_live.post_json(
        "/v1/completions",
        {"prompt": "".join(f"value_{i} = compute({i})\n" for i in range(30)), "max_tokens": 2, "temperature": 0},
    )
    deadline = time.monotonic() + 20
    while True:
        text = default_live.get("/metrics").body.decode()
        used = _sample(text, "himamba_pool_used_bytes", kind="kv", tier="storage")
        if used > 0 or time.monotonic() > deadline:  # NaN > 0 is False: keep scraping
            break
        time.sleep(REPORT_INTERVAL_S)
    assert _sample(text, "himamba_cache_storage_up") == 1
    assert _sample(text, "himamba_pool_capacity_bytes", kind="kv", tier="storage") > 0
    # The demo model is hybrid: the tier stores states too, under the same cap.
    assert _sample(text, "himamba_pool_capacity_bytes", kind="mamba", tier="storage") > 0
    assert used > 0, "the backup is on disk but the storage pool shows nothing"


def test_the_storage_pool_reports_a_capacity_for_every_kind_it_stores():
    """KV pages and states share the storage cap: each kind's capacity is what it holds plus the
    shared free part (the cap reported under kv alone left states with capacity 0)."""
    from himamba.services.cache.service import storage_pool_bytes
    from himamba.services.cache.storage.base import StorageStats

    stats = StorageStats(used_bytes=700, used_state_bytes=200, capacity_bytes=1000)
    assert storage_pool_bytes(stats) == {"kv": (800, 500), "mamba": (500, 200)}
    assert storage_pool_bytes(StorageStats(used_bytes=700, used_state_bytes=200)) == {"kv": (0, 500), "mamba": (0, 200)}
