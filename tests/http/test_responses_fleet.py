"""/v1/responses across a fleet: two servers (alpha and beta) behind a router, each a TokenizerService
with a fake scheduler. Response ids name their server; with a shared storage tier (a file directory
both use; Redis when a redis-server is installed) a response made on alpha is continued, read and
deleted on beta; without one, beta's 404 names alpha. The failure paths: a store that refuses writes
does not fail the response, and a store that cannot be read is a 503 naming the owner."""

from __future__ import annotations

import grp
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from himamba.common import config as config_mod
from himamba.services.cache.storage.file import default_storage_dir as cache_default_dir
from himamba.services.tokenizer.http import shared_responses
from himamba.services.tokenizer.http.response_ids import new_response_id, parse_id, server_name
from himamba.services.tokenizer.http.shared_responses import FileRecords, RedisRecords, SharedStoreError, open_records
from tests.http.test_responses_api import CACHED, KEY, TEMPLATE, Harness
from tests.http_request import free_port
from tests.system_packages import REDIS, skip_without
from tests.tokenizer.fakes import FakeScheduler, running_service, service_config, write_model_dir


@contextmanager
def _server(tmp: Path, tokenizer: Tokenizer, name: str, cache: dict[str, Any]) -> Iterator[Harness]:
    """One server of the fleet, named `name`, with `cache` as its [cache] config."""
    (tmp / name).mkdir()
    model_dir = write_model_dir(tmp / name, tokenizer, {"eos_token": "<|endoftext|>", "chat_template": TEMPLATE})
    cfg = service_config(
        model_dir,
        1024,
        model={"served_model_name": "fake-model"},
        scheduler={"default_max_tokens": 200},
        endpoints={"instance": name},
        cache=cache,
        http={"port": free_port(), "api_key": KEY},
    )
    scheduler = FakeScheduler(cfg, tokenizer, "plain answer text", CACHED)
    try:
        with running_service(cfg):
            yield Harness(cfg.http.port, scheduler, tokenizer)
    finally:
        scheduler.close()


@contextmanager
def _fleet(tmp: Path, tokenizer: Tokenizer, cache: dict[str, Any]) -> Iterator[tuple[Harness, Harness]]:
    with ExitStack() as stack:
        yield (
            stack.enter_context(_server(tmp, tokenizer, "alpha", cache)),
            stack.enter_context(_server(tmp, tokenizer, "beta", cache)),
        )


def _create(h: Harness, body: dict[str, Any]) -> dict[str, Any]:
    r = h.request("POST", "/v1/responses", body)
    assert r.status == 200, r.body
    return r.json()


def _error(r: Any, status: int) -> dict[str, Any]:
    assert r.status == status, r.body
    return r.json()["error"]


def _store_errors(h: Harness, op: str) -> float:
    text = h.request("GET", "/metrics").body.decode()
    m = re.search(rf'himamba_responses_shared_store_errors_total{{[^}}]*store_op="{op}"[^}}]*}} (\S+)', text)
    assert m is not None, "the counter is exported from the start"
    return float(m.group(1))


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared-tier")


@pytest.fixture(scope="module")
def shared_fleet(
    tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Tokenizer, shared_dir: Path
) -> Iterator[tuple[Harness, Harness]]:
    with _fleet(tmp_path_factory.mktemp("fleet"), demo_tokenizer, {"hicache_storage_dir": str(shared_dir)}) as f:
        yield f


# ---------------------------------------------------------------- ids


def test_ids_name_their_server_and_nothing_else_parses():
    assert server_name("alpha", 30000) == "alpha"
    assert server_name("my_box", 1) == "my-box"  # '_' separates an id's parts
    rid = new_response_id("gpu-7.example")
    assert parse_id(rid) == (rid, "gpu-7.example")
    assert parse_id("resp_" + "ab" * 16) == ("resp_" + "ab" * 16, "")  # the older shape: no one's
    for bad in ("resp_nope", "resp_../../etc_" + "0" * 32, "resp_a/b_" + "0" * 32, "msg_" + "0" * 32):
        assert parse_id(bad) is None


def test_the_default_directory_is_the_cache_tier_s():
    assert shared_responses.default_storage_dir() == cache_default_dir()


@pytest.mark.parametrize(
    ("cache", "http", "opened"),
    [
        ({"hicache_storage_dir": "/srv/tier"}, {}, "/srv/tier/responses"),
        ({"hicache_storage_backend": "redis", "hicache_storage_url": "redis://:pw@store:6379/1"}, {},
         "redis://store:6379/1"),
        ({"hicache_storage_backend": "mooncake"}, {}, None),  # a KV-page transport: memory only
        ({}, {}, None),  # no storage tier
        ({"hicache_storage_dir": "/srv/tier"}, {"responses_shared": False}, None),
        ({"hicache_storage_dir": "/srv/tier"}, {"responses_store_max": 0}, None),
        ({"hicache_storage_backend": "redis", "hicache_storage_url": "ftp://store"}, {}, None),  # not a Redis URL
        ({"hicache_storage_dir": "/srv/tier", "hicache_storage_group": "no-such-group-here"}, {}, None),
    ],
)  # fmt: skip
def test_which_store_a_server_opens(cache: dict[str, Any], http: dict[str, Any], opened: str | None):
    cfg = config_mod.load(overrides={"cache": cache, "http": http})
    records = open_records(cfg, logging.getLogger("test"))
    assert (records.where if records is not None else None) == opened


# ---------------------------------------------------------------- a shared file tier


def test_a_response_made_on_one_server_is_continued_on_another(shared_fleet: tuple[Harness, Harness]):
    alpha, beta = shared_fleet
    first = _create(alpha, {"input": "fleet-hello please"})
    assert first["id"].startswith("resp_alpha_") and first["store"] is True
    first_prompt = alpha.add_request("fleet-hello").input_ids
    turn = {"input": "fleet-more please", "previous_response_id": first["id"]}
    on_alpha = _create(alpha, turn)
    on_beta = _create(beta, turn)
    assert on_beta["id"].startswith("resp_beta_") and on_beta["previous_response_id"] == first["id"]
    ids_alpha = alpha.add_request("fleet-more").input_ids
    ids_beta = beta.add_request("fleet-more").input_ids
    # The same prompt ids, extending the first turn's (not a re-rendering): the same greedy tokens.
    assert ids_beta == ids_alpha and ids_alpha[: len(first_prompt)] == first_prompt
    assert on_beta["output"][0]["content"][0]["text"] == on_alpha["output"][0]["content"][0]["text"]
    # GET and input_items on the server that did not make it
    got = beta.request("GET", f"/v1/responses/{first['id']}")
    assert got.status == 200 and got.json()["output"] == first["output"]
    items = beta.request("GET", f"/v1/responses/{on_alpha['id']}/input_items?order=asc").json()["data"]
    assert [i["type"] for i in items] == ["message", "message", "message"]  # turn 1, its answer, turn 2


def test_delete_removes_it_from_the_shared_store(shared_fleet: tuple[Harness, Harness], shared_dir: Path):
    alpha, beta = shared_fleet
    made = _create(alpha, {"input": "fleet-delete-me"})
    assert (shared_dir / "responses" / f"{made['id']}.rec").is_file()
    assert alpha.request("DELETE", f"/v1/responses/{made['id']}").json()["deleted"] is True
    assert not (shared_dir / "responses" / f"{made['id']}.rec").exists()
    err = _error(beta.request("GET", f"/v1/responses/{made['id']}"), 404)
    assert "belongs to server 'alpha'" in err["message"] and "shared store" in err["message"]
    # beta deletes what alpha made (the shared copy; alpha's memory copy goes with alpha's own DELETE)
    other = _create(alpha, {"input": "fleet-delete-elsewhere"})
    assert beta.request("DELETE", f"/v1/responses/{other['id']}").status == 200
    assert not (shared_dir / "responses" / f"{other['id']}.rec").exists()
    assert _error(beta.request("DELETE", f"/v1/responses/{other['id']}"), 404)["code"] == "not_found"


def test_a_store_that_refuses_writes_does_not_fail_the_response(
    shared_fleet: tuple[Harness, Harness], shared_dir: Path
):
    """The record directory replaced by a file: every write and read of the tier fails."""
    alpha, beta = shared_fleet
    records = shared_dir / "responses"
    moved = shared_dir / "responses.away"
    records.rename(moved)
    records.write_text("not a directory")
    try:
        before = _store_errors(alpha, "write")
        made = _create(alpha, {"input": "fleet-store-down short-one"})
        assert made["status"] == "completed" and made["store"] is True  # kept in alpha's memory
        assert _store_errors(alpha, "write") == before + 1
        assert alpha.request("GET", f"/v1/responses/{made['id']}").status == 200
        # beta cannot tell whether it exists: 503, which says whose it is
        reads = _store_errors(beta, "read")
        turn = {"input": "fleet-after", "previous_response_id": made["id"]}
        err = _error(beta.request("POST", "/v1/responses", turn), 503)
        assert err["code"] == "response_store_unavailable" and err["param"] == "previous_response_id"
        assert "could not be read" in err["message"] and "server 'alpha'" in err["message"]
        assert _store_errors(beta, "read") == reads + 1
        deletes = _store_errors(beta, "delete")
        err = _error(beta.request("DELETE", f"/v1/responses/{made['id']}"), 503)  # it may be there: not gone
        assert err["code"] == "response_store_unavailable" and _store_errors(beta, "delete") == deletes + 1
    finally:
        records.unlink()
        moved.rename(records)


def test_a_damaged_record_or_another_model_s_is_not_found(shared_fleet: tuple[Harness, Harness], shared_dir: Path):
    alpha, beta = shared_fleet
    made = _create(alpha, {"input": "fleet-damaged"})
    path = shared_dir / "responses" / f"{made['id']}.rec"
    record = json.loads(path.read_bytes())
    path.write_bytes(b"{not json")
    assert _error(beta.request("GET", f"/v1/responses/{made['id']}"), 404)["code"] == "not_found"
    path.write_text(json.dumps({**record, "model": "other-model"}))  # its token ids mean nothing here
    err = _error(beta.request("GET", f"/v1/responses/{made['id']}"), 404)
    assert "made by model 'other-model'" in err["message"] and "'fake-model'" in err["message"]


# ---------------------------------------------------------------- no shared store


def test_without_a_shared_store_the_404_names_the_owner(tmp_path: Path, demo_tokenizer: Tokenizer):
    with _fleet(tmp_path, demo_tokenizer, {}) as (alpha, beta):
        made = _create(alpha, {"input": "fleet-sticky"})
        turn = {"input": "next", "previous_response_id": made["id"]}
        err = _error(beta.request("POST", "/v1/responses", turn), 404)
        assert err["param"] == "previous_response_id" and err["code"] == "not_found"
        assert "another server, 'alpha'" in err["message"] and "previous_response_id" in err["message"]
        assert "sticky" in err["message"]
        assert "'alpha'" in _error(beta.request("GET", f"/v1/responses/{made['id']}"), 404)["message"]
        # an id of beta's own that it no longer holds (expired, restarted) is the plain 404
        mine = new_response_id("beta")
        err = _error(beta.request("GET", f"/v1/responses/{mine}"), 404)
        assert err["message"] == f"Response with id '{mine}' not found."
        assert alpha.request("POST", "/v1/responses", turn).status == 200  # the owner continues it


# ---------------------------------------------------------------- the records stores


def _record(n: int) -> bytes:
    return json.dumps({"n": n, "pad": "x" * 100}).encode()


def test_file_records_are_bounded_by_count_and_bytes(tmp_path: Path):
    store = FileRecords(tmp_path / "r", max_count=2, max_bytes=10_000)
    ids = [new_response_id("a") for _ in range(3)]
    for n, rid in enumerate(ids):
        assert store.put(rid, _record(n))
        os.utime(store.dir / f"{rid}.rec", (n, n))  # recency is the file's mtime: distinct ones
    assert store.get(ids[0]) is None and store.get(ids[2]) == _record(2)
    small = FileRecords(tmp_path / "s", max_count=100, max_bytes=2 * len(_record(0)) + 1)
    for n, rid in enumerate(ids):
        small.put(rid, _record(n))
        os.utime(small.dir / f"{rid}.rec", (n, n))
    assert [small.get(rid) is not None for rid in ids] == [False, True, True]
    assert not small.put(ids[0], b"x" * small.max_bytes + b"x")  # larger than the whole budget
    assert (tmp_path / "r").stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (tmp_path / "r").iterdir())
    assert store.delete(ids[2]) and not store.delete(ids[2])
    # the record just written is never the one dropped, even when another looks newer (a clock ahead)
    one = FileRecords(tmp_path / "one", max_count=1, max_bytes=10_000)
    one.put(ids[0], _record(0))
    os.utime(one.dir / f"{ids[0]}.rec", (2**31, 2**31))
    assert one.put(ids[1], _record(1)) and one.get(ids[1]) == _record(1) and one.get(ids[0]) is None


def test_file_records_directories_get_their_modes_whatever_the_umask(tmp_path: Path):
    """Every directory the store creates (parents included) is 0700, or 0750 and the group's for
    --hicache-storage-group, as the cache's own: not 0777 under an open umask (others could plant
    files), not 0700 under umask 077 when a group was asked to read."""
    group = grp.getgrgid(1 if os.geteuid() == 0 else os.getegid())  # root may give files to any group
    for umask, top, name in ((0, "open", ""), (0o077, "tight", group.gr_name)):
        old = os.umask(umask)
        try:
            store = FileRecords(tmp_path / top / "store" / "responses", max_count=2, max_bytes=10_000, group=name)
            assert store.put(new_response_id("a"), _record(0))
        finally:
            os.umask(old)
    for top, want in (("open", (0o700, None)), ("tight", (0o750, group.gr_gid))):
        for d in (tmp_path / top, tmp_path / top / "store", tmp_path / top / "store" / "responses"):
            st = d.stat()
            assert (stat.S_IMODE(st.st_mode), want[1] and st.st_gid) == want, (d, oct(st.st_mode))


def test_a_file_record_write_that_fails_leaves_no_temporary_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A full disk fails the write: the half-written temporary goes too (the bounds count only
    records, so a left one would hold its space for good)."""
    import errno

    store = FileRecords(tmp_path / "r", max_count=2, max_bytes=10_000)
    assert store.put(new_response_id("a"), _record(0))

    def full(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared_responses.os, "write", full)
    with pytest.raises(SharedStoreError, match="No space left"):
        store.put(new_response_id("a"), _record(1))
    monkeypatch.undo()
    assert [p.suffix for p in store.dir.iterdir()] == [".rec"]


def test_file_records_that_cannot_be_read_raise(tmp_path: Path):
    (tmp_path / "r").write_text("a file")
    store = FileRecords(tmp_path / "r", max_count=2, max_bytes=10_000)
    rid = new_response_id("a")
    for call in (lambda: store.put(rid, b"{}"), lambda: store.get(rid), lambda: store.delete(rid)):
        with pytest.raises(SharedStoreError):
            call()


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    skip_without(REDIS)
    server = shutil.which("redis-server")
    assert server is not None
    pytest.importorskip("redis")
    port = free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_redis_records_are_bounded_and_deleted(redis_url: str):
    store = RedisRecords(redis_url, max_count=2, max_bytes=3 * len(_record(0)))
    ids = [new_response_id("a") for _ in range(3)]
    for n, rid in enumerate(ids):
        assert store.put(rid, _record(n))
    assert store.get(ids[0]) is None and store.get(ids[1]) == _record(1)
    store.put(ids[2], _record(2) + b" " * (3 * len(_record(0)) // 2))  # 3.5 sizes in all: the oldest goes
    assert store.get(ids[1]) is None and store.get(ids[2]) is not None
    assert store.delete(ids[2]) and not store.delete(ids[2]) and store.get(ids[2]) is None
    assert not store.put(ids[0], b"x" * (store.max_bytes + 1))


def test_redis_records_unreachable_raise_without_the_password():
    store = RedisRecords(f"redis://:hunter2@127.0.0.1:{free_port()}/0", max_count=2, max_bytes=1000)
    with pytest.raises(SharedStoreError) as got:
        store.get(new_response_id("a"))
    assert "hunter2" not in str(got.value) and "127.0.0.1" in str(got.value)
    with pytest.raises(SharedStoreError, match="unreachable"):  # away: not tried again at once
        store.put(new_response_id("a"), b"{}")
