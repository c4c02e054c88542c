"""`himamba bench multiturn --peer-url`: the same conversations, through the same HTTP client, to our
server and to a peer (here a second himamba server with its prefix cache off, standing in for
`vllm serve`), side by side; and the HTTP client's failure paths."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from himamba.bench.multiturn import main
from himamba.bench.openai_turns import OpenAITurns
from himamba.bench.servers import free_port, start_server
from himamba.bench.workload import Turn
from himamba.services.modelgen.checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("nemotron_h", tmp_path_factory.mktemp("model") / "tiny", preset="tiny", seed=0)


@pytest.mark.slow
def test_ours_and_the_peer_side_by_side(tiny_model, tmp_path, capsys):
    port = free_port()
    peer = start_server(tiny_model, tmp_path / "peer-logs", "--port", str(port), "--disable-radix-cache")
    try:
        out = tmp_path / "out"
        argv = ["--configs", "device", "--peer-url", f"http://127.0.0.1:{port}", "--model", str(tiny_model),
                "--num-clients", "2", "--max-parallel", "2", "--num-rounds", "2", "--request-length", "24",
                "--output-length", "3", "--request-rate", "inf", "--seed", "3", "--out", str(out), "--no-progress"]  # fmt: skip
        assert main(argv) == 0
    finally:
        peer.stop()
    printed = capsys.readouterr().out
    assert f"ours vs the peer at http://127.0.0.1:{port}" in printed
    report = json.loads((out / "multiturn.json").read_text())
    rows = {r["config"]: r for r in report["results"]}
    assert set(rows) == {"device", "peer"}
    for row in rows.values():
        assert row["num_requests"] == 4 and row["num_failed"] == 0 and row["ttft_p99_s"] > 0
        assert row["output_tokens_per_s"] > 0 and row["ideal_ratio"] > 0
    # Round 2 repeats round 1 and its answer: ours (radix cache on) serves part of it from cache,
    # the peer (off) none; each figure came back through the HTTP usage.
    assert rows["device"]["cached_ratio"]["total"] > 0 and rows["peer"]["cached_ratio"]["total"] == 0
    assert report["peer"]["url"] == f"http://127.0.0.1:{port}" and report["peer"]["model"]
    (versus,) = report["peer"]["comparison"]
    assert versus["config"] == "device" and versus["request_rate"] == "inf"
    assert (
        versus["ttft_p50_s"] == rows["device"]["ttft_p50_s"] and versus["peer_ttft_p50_s"] == rows["peer"]["ttft_p50_s"]
    )
    assert versus["ttft_p99_speedup"] == pytest.approx(rows["peer"]["ttft_p99_s"] / rows["device"]["ttft_p99_s"])
    assert versus["output_tokens_throughput_gain"] == pytest.approx(
        rows["device"]["output_tokens_per_s"] / rows["peer"]["output_tokens_per_s"]
    )


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--peer-url", "127.0.0.1:8000"], "must be an http:// or https:// URL"),
        (["--peer-url", "http://127.0.0.1:8000", "--endpoint", "ipc://x", "--model", "m"], "--endpoint is a ZeroMQ"),
    ],
)
def test_a_bad_peer_flag_is_a_usage_error(argv, says, capsys):
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_a_peer_without_models_is_named_before_any_server_starts(tiny_model, tmp_path, capsys):
    argv = ["--peer-url", f"http://127.0.0.1:{free_port()}", "--model", str(tiny_model), "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "no model listed at /v1/models" in capsys.readouterr().err


async def _one_round(handler) -> tuple:
    """One round through OpenAITurns against an aiohttp stand-in answering /v1/completions."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with OpenAITurns(f"http://127.0.0.1:{port}", "m") as turns:
            return await turns.timed_request(Turn(client=0, round=1, input_ids=[5, 6, 7], repeated_len=0), 2)
    finally:
        await runner.cleanup()


async def _sse(request: web.Request, events: list[dict]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


def test_token_ids_and_cached_tokens_come_from_the_stream():
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["prompt"] == [5, 6, 7] and body["return_token_ids"] and body["stream"] and body["ignore_eos"]
        return await _sse(
            request,
            [
                {"choices": [{"index": 0, "text": "a", "token_ids": [11], "finish_reason": None}]},
                {"choices": [{"index": 0, "text": "b", "token_ids": [12], "finish_reason": "length"}]},
                {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 2}}},
            ],
        )

    rec, ids = asyncio.run(_one_round(handler))
    assert rec.ok and ids == [11, 12] and rec.completion_tokens == 2
    assert rec.ttft_s is not None and len(rec.itl_s) == 1 and rec.e2e_s is not None
    assert rec.cached == {"device": 2, "host": 0, "storage": 0}  # a total only: counted as device


def test_a_server_streaming_no_token_ids_cannot_continue_the_conversation():
    async def handler(request: web.Request) -> web.StreamResponse:
        return await _sse(request, [{"choices": [{"index": 0, "text": "ab", "finish_reason": "length"}]}])

    rec, ids = asyncio.run(_one_round(handler))
    assert not rec.ok and "streams no token ids" in (rec.error or "") and ids == []


def test_a_refusal_is_the_rounds_error_naming_the_answer():
    async def handler(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "prompt too long"}}, status=400)

    rec, _ = asyncio.run(_one_round(handler))
    assert not rec.ok and "answered 400" in (rec.error or "") and "prompt too long" in (rec.error or "")


def test_fewer_tokens_than_asked_for_is_an_error():
    async def handler(request: web.Request) -> web.StreamResponse:
        return await _sse(
            request, [{"choices": [{"index": 0, "text": "a", "token_ids": [11], "finish_reason": "stop"}]}]
        )

    rec, _ = asyncio.run(_one_round(handler))
    assert rec.error == "1 tokens came back, 2 were asked for"
