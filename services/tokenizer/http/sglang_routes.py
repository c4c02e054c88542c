"""sglang's native routes, so that a himamba server is a first-class worker behind sglang's model
gateway (`sglang-router`, a Rust router with a `cache_aware` policy) and its clients.

- `GET /server_info` (and `/get_server_info`): what the gateway reads to register a worker
  (`served_model_name`, `model_path`, `tp_size`, `dp_size`, `max_total_tokens`, ...) and the whole
  config tree, with every secret left out (the API key, credentials in store URLs);
- `GET /model_info` (and `/get_model_info`): `model_path`, `tokenizer_path`, `is_generation`,
  `model_type`, `architectures` (from the checkpoint's config.json);
- `GET /health_generate`: 200 once a one-token generation went through every service;
- `POST|GET /flush_cache`: the cache controller empties this server's device and host tiers (only
  when idle, as sglang; the storage tier, maybe shared, keeps its entries);
- `POST /generate`: `text` or `input_ids`, `sampling_params`, `stream`; the answer is sglang's
  `{"text", "output_ids", "meta_info"}` (a list of them for n > 1), or server-sent events of it
  (cumulative text and ids, as sglang's default) ending with `data: [DONE]`.

Generation takes the front door's one request path (`open_stream`), as the OpenAI routes do.
Fields we do not support are refused with a 400 naming them, never ignored.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import msgspec
from aiohttp import web
from tokenizers import Tokenizer

from himamba.common.config import Config, to_toml_dict
from himamba.common.messages import CacheFlushed, ErrorReply, GenerateChunk, GenerateRequest, WorkerInfo
from himamba.common.types import GrammarSpec, SamplingParams, Usage
from himamba.services.tokenizer.generation_defaults import SamplingDefaults
from himamba.services.tokenizer.http.bodies import API_DEFAULTS, logit_bias_of
from himamba.services.tokenizer.http.connections import read_body
from himamba.services.tokenizer.http.errors import ApiError, param_of_message
from himamba.services.tokenizer.http.structured_outputs import (
    check_constraint,
    sglang_grammar_field,
    sglang_sampling_grammar,
)
from himamba.services.tokenizer.local_clients import ReplyStream
from himamba.services.tokenizer.peers import Readiness

ROUTES = {  # path -> the route label of the HTTP metrics
    "/server_info": "server_info",
    "/get_server_info": "server_info",
    "/model_info": "model_info",
    "/get_model_info": "model_info",
    "/health_generate": "health_generate",
    "/flush_cache": "flush_cache",
    "/generate": "generate",
}
_HEALTH_GENERATE_TIMEOUT_S = 30.0
_KNOWN_STATUS = {400, 404, 409, 500, 503}
_REDACTED = "<redacted>"


class SglangDoor(Protocol):
    """What these routes need from the tokenizer service."""

    cfg: Config
    model_name: str
    tokenizer: Tokenizer
    worker_info: WorkerInfo | None  # the pools' sizes, once the worker said them
    sampling_defaults: SamplingDefaults  # generation_config.json's, for fields a request leaves out

    def readiness(self) -> Readiness: ...

    async def open_stream(self, req: GenerateRequest) -> ReplyStream: ...

    async def flush_cache(self) -> CacheFlushed: ...

    async def check_grammar(self, spec: GrammarSpec) -> None: ...


# ---------------------------------------------------------------- request bodies


class SamplingBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """sglang's `sampling_params` (its names and defaults); the ones we cannot honour are refused."""

    max_new_tokens: int | None = None  # None: as an OpenAI request that leaves out max_tokens
    # None (left out): the checkpoint's generation_config.json value, else sglang's default (API_DEFAULTS).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 (sglang) or 0: no top-k
    min_p: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    n: int = 1
    sampling_seed: int | None = None
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # structured outputs (structured_outputs.py): at most one
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class GenerateBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """POST /generate: one prompt, as text or token ids."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: SamplingBody = SamplingBody()
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # sglang-router 0.3 sends these at their defaults in every /generate body it forwards.
    model: str | None = None
    return_text_in_logprobs: bool = False
    log_metrics: bool = True
    no_logs: bool = False  # either way: the server logs no request content
    return_hidden_states: bool = False
    background: bool = False
    return_bytes: bool = False
    return_entropy: bool = False


# Accepted only at the value that means "what himamba does anyway".
_ONLY_BODY = {
    "return_text_in_logprobs": (False, "return_text_in_logprobs is not supported (must be false)"),
    "log_metrics": (True, "log_metrics: every request counts in the metrics (must be true)"),
    "return_hidden_states": (False, "return_hidden_states is not supported (must be false)"),
    "background": (False, "background is not supported (must be false)"),
    "return_bytes": (False, "return_bytes is not supported (must be false)"),
    "return_entropy": (False, "return_entropy is not supported (must be false)"),
}
_ONLY = {
    "min_new_tokens": (0, "min_new_tokens is not supported (must be 0)"),
    "skip_special_tokens": (True, "skip_special_tokens: special tokens are always skipped (must be true)"),
    "spaces_between_special_tokens": (True, "spaces_between_special_tokens must be true"),
    "no_stop_trim": (False, "no_stop_trim is not supported: stop strings are trimmed (must be false)"),
}


def _decode(raw: bytes) -> GenerateBody:
    try:
        return msgspec.json.decode(raw, type=GenerateBody)
    except msgspec.ValidationError as e:
        text = str(e)
        param = None
        if "unknown field `" in text:
            param = text.split("unknown field `", 1)[1].split("`", 1)[0]
            text = f"{param} is not supported"
        elif "`$." in text:
            param = text.rsplit("`$.", 1)[1].rstrip("`").split("[", 1)[0].rsplit(".", 1)[-1]
        raise ApiError(400, f"invalid request: {text}", param=param, code="invalid_type") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None


def _prompt(body: GenerateBody) -> tuple[str | None, list[int] | None]:
    """(text, input_ids): exactly one of them; a batch of one is that one prompt."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "send exactly one of text and input_ids", param="text")
    text: Any = body.text
    if isinstance(text, list):
        if len(text) != 1:
            raise ApiError(400, "batched requests are not supported: send one prompt per request", param="text")
        text = text[0]
    if text is not None:
        return text, None
    ids: Any = body.input_ids
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            raise ApiError(400, "batched requests are not supported: send one prompt per request", param="input_ids")
        ids = ids[0]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError(400, "input_ids must be a list of token ids", param="input_ids")
    return None, list(ids)


def _sampling(body: GenerateBody, defaults: Mapping[str, float | int]) -> SamplingParams:
    """The request's sampling; a field it leaves out takes `defaults` (generation_config.json's),
    else sglang's own."""
    for name, (allowed, message) in _ONLY_BODY.items():
        if getattr(body, name) != allowed:
            raise ApiError(400, message, param=name)
    sp = body.sampling_params
    for name, (allowed, message) in _ONLY.items():
        if getattr(sp, name) != allowed:
            raise ApiError(400, message, param=name)
    if body.top_logprobs_num:
        raise ApiError(
            400, "top_logprobs_num is not supported (only the chosen tokens' logprobs)", param="top_logprobs_num"
        )
    if body.logprob_start_len != -1:
        raise ApiError(
            400, "prompt logprobs are not supported: logprob_start_len must be -1", param="logprob_start_len"
        )
    if sp.top_k is not None and sp.top_k < -1:
        raise ApiError(400, f"top_k must be -1 (off) or >= 0, got {sp.top_k}", param="top_k")
    chosen = {**API_DEFAULTS, **defaults}
    given = {f: v for f in API_DEFAULTS if (v := getattr(sp, f)) is not None}
    values: dict[str, Any] = {**chosen, **given}
    stop = [] if sp.stop is None else [sp.stop] if isinstance(sp.stop, str) else list(sp.stop)
    return SamplingParams(
        max_tokens=sp.max_new_tokens,
        temperature=float(values["temperature"]),
        top_p=float(values["top_p"]),
        top_k=max(int(values["top_k"]), 0),
        min_p=float(values["min_p"]),
        seed=sp.sampling_seed,
        stop=stop,
        stop_token_ids=list(sp.stop_token_ids or []),
        ignore_eos=sp.ignore_eos,
        repetition_penalty=float(values["repetition_penalty"]),
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        n=sp.n,
        logprobs=body.return_logprob,
        grammar=sglang_sampling_grammar(sp),
        logit_bias=logit_bias_of(sp.logit_bias),
    )


# ---------------------------------------------------------------- answers


def _reply_error(reply: ErrorReply) -> ApiError:
    status = reply.code if reply.code in _KNOWN_STATUS else 500
    return ApiError(status, reply.message, param=param_of_message(reply.message) if status == 400 else None)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def _finish_reason(reason: str | None, completion_tokens: int, matched: int | str | None) -> dict[str, Any] | None:
    """sglang's shape: {"type": "length", "length": N}, {"type": "stop", "matched": ...}, {"type": "abort"}."""
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": reason}


class _Sample:
    """One sample's text and ids so far (sglang streams them cumulatively)."""

    def __init__(self, prompt_len: int):
        self.text = ""
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.prompt_len = prompt_len
        self.usage: Usage | None = None
        self.finish: str | None = None
        self.matched: int | str | None = None

    def add(self, chunk: GenerateChunk) -> None:
        self.text += chunk.text
        self.ids.extend(chunk.token_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if chunk.prompt_token_ids is not None:
            self.prompt_len = len(chunk.prompt_token_ids)
        if chunk.finished:
            self.usage = chunk.usage
            self.finish = chunk.finish_reason or "stop"
            self.matched = chunk.matched_stop

    def answer(self, rid: str, index: int, started: float, logprobs: bool, n: int) -> dict[str, Any]:
        u = self.usage
        completion = u.completion_tokens if u is not None else len(self.ids)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": _finish_reason(self.finish, completion, self.matched),
            "prompt_tokens": u.prompt_tokens if u is not None else self.prompt_len,
            "completion_tokens": completion,
            "cached_tokens": u.cached_tokens.total if u is not None else 0,
            "e2e_latency": time.monotonic() - started,
        }
        if u is not None:  # himamba's extension: which tier served the cached prompt tokens
            c = u.cached_tokens
            meta["cached_tokens_by_tier"] = {"device": c.device, "host": c.host, "storage": c.storage}
        if logprobs:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(self.logprobs, self.ids, strict=False)]
        out: dict[str, Any] = {"text": self.text, "output_ids": list(self.ids), "meta_info": meta}
        if n > 1:
            out["index"] = index
        return out


def _redact_url(url: str) -> str:
    """A store URL without its password (redis://user:secret@host -> redis://user:<redacted>@host)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _REDACTED
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:" if parts.username else ":"
    return urlunsplit((parts.scheme, f"{user}{_REDACTED}@{host}", parts.path, parts.query, parts.fragment))


def public_config(cfg: Config) -> dict[str, Any]:
    """The config tree with every secret left out: the API key, and passwords in store URLs."""
    tree = to_toml_dict(cfg)
    tree["http"]["api_key"] = _REDACTED if cfg.http.api_key else ""
    cache = tree["cache"]
    for key in ("hicache_storage_url", "mooncake_metadata_server"):
        cache[key] = _redact_url(cache[key])
    return tree


def _checkpoint_config(model_dir: str) -> dict[str, Any]:
    try:
        data = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class SglangRoutes:
    """The handlers of sglang's native routes (see the module docstring)."""

    def __init__(self, door: SglangDoor):
        self.door = door
        self._checkpoint = _checkpoint_config(door.cfg.model.model)
        try:
            self._version = importlib.metadata.version("himamba")
        except importlib.metadata.PackageNotFoundError:
            self._version = "unknown"

    def add_routes(self, router: web.UrlDispatcher) -> None:
        for path in ("/server_info", "/get_server_info"):
            router.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            router.add_get(path, self.model_info)
        router.add_get("/health_generate", self.health_generate)
        router.add_post("/flush_cache", self.flush_cache)
        router.add_get("/flush_cache", self.flush_cache)
        router.add_post("/generate", self.generate)

    # ------------------------------------------------------------ discovery

    async def server_info(self, request: web.Request) -> web.Response:
        cfg = self.door.cfg
        m, c, s = cfg.model, cfg.cache, cfg.scheduler
        info: dict[str, Any] = {
            "version": self._version,
            "engine": "himamba",
            "model_path": m.model,
            "tokenizer_path": m.tokenizer or m.model,
            "served_model_name": self.door.model_name,
            "tp_size": 1,
            "dp_size": 1,
            "context_length": m.max_context_len,
            "max_running_requests": s.max_running_requests,
            "max_prefill_tokens": s.chunked_prefill_size,
            "chunked_prefill_size": s.chunked_prefill_size,
            "page_size": c.page_size,
            "hicache_storage_backend": c.hicache_storage_backend,
            "config": public_config(cfg),
        }
        w = self.door.worker_info
        if w is not None:  # the pools as sized (sglang's names where it has one)
            info["max_total_tokens"] = w.num_pages * c.page_size
            info["max_mamba_cache_size"] = w.num_state_slots
            info["hicache_tokens"] = w.num_host_pages * c.page_size
            info["hicache_mamba_slots"] = w.num_host_state_slots
            info["random_weights"] = w.random_weights
        return _json(info)

    async def model_info(self, request: web.Request) -> web.Response:
        m = self.door.cfg.model
        ckpt = self._checkpoint
        archs = ckpt.get("architectures")
        return _json(
            {
                "model_path": m.model,
                "tokenizer_path": m.tokenizer or m.model,
                "served_model_name": self.door.model_name,
                "is_generation": True,
                "model_type": ckpt.get("model_type"),
                "architectures": archs if isinstance(archs, list) else None,
                "max_context_length": m.max_context_len,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "preferred_sampling_params": None,
            }
        )

    # ------------------------------------------------------------ health and cache

    async def health_generate(self, request: web.Request) -> web.Response:
        state = self.door.readiness()
        if not state.ready:
            raise ApiError(503, f"not ready: waiting for {', '.join(state.not_ready)}", code="not_ready")
        req = GenerateRequest(
            rid=f"health-generate-{uuid.uuid4().hex}",
            input_ids=[0],
            sampling=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
            stream=False,
        )
        stream = await self.door.open_stream(req)
        try:
            reply = await asyncio.wait_for(stream.next(), _HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            raise ApiError(503, f"no token within {_HEALTH_GENERATE_TIMEOUT_S:.0f} s", code="not_ready") from None
        finally:
            await stream.close()
        if isinstance(reply, ErrorReply):
            raise ApiError(503, f"generation failed: {reply.message}", code="not_ready")
        return _json({"status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        try:
            reply = await self.door.flush_cache()
        except TimeoutError:
            raise ApiError(503, "the cache service did not answer", code="not_ready") from None
        if not reply.ok:
            raise ApiError(409, f"cache not flushed: {reply.error}", code="cache_in_use")
        freed = {
            "device_pages": reply.device_pages,
            "device_states": reply.device_states,
            "host_pages": reply.host_pages,
            "host_states": reply.host_states,
        }
        return _json({"message": "Cache flushed.", "freed": freed})

    # ------------------------------------------------------------ generation

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = _decode(await read_body(request, self.door.cfg.http.body_timeout_s))
        if body.model is not None and body.model != self.door.model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist", param="model", code="model_not_found")
        text, input_ids = _prompt(body)
        sampling = _sampling(body, self.door.sampling_defaults.values())
        field = lambda: sglang_grammar_field(body.sampling_params)  # noqa: E731
        await check_constraint(sampling.grammar, field, self.door.check_grammar)
        rid = body.rid or uuid.uuid4().hex
        req = GenerateRequest(rid=rid[:256], prompt=text, input_ids=input_ids, sampling=sampling, stream=body.stream)
        started = time.monotonic()
        n = sampling.n
        samples = [_Sample(len(input_ids) if input_ids is not None else 0) for _ in range(n)]
        stream = await self.door.open_stream(req)
        try:
            first = stream.ready_nowait()
            if isinstance(first, ErrorReply):
                raise _reply_error(first)
            if not body.stream:
                await self._collect(stream, first, samples)
                answers = [s.answer(rid, i, started, body.return_logprob, n) for i, s in enumerate(samples)]
                return _json(answers[0] if n == 1 else answers)
            return await self._stream(request, stream, first, samples, rid, started, body.return_logprob)
        finally:
            await stream.close()

    async def _collect(self, stream: ReplyStream, first: GenerateChunk | None, samples: list[_Sample]) -> None:
        reply: ErrorReply | GenerateChunk = first if first is not None else await stream.next()
        unfinished = len(samples)
        while True:
            if isinstance(reply, ErrorReply):
                raise _reply_error(reply)
            samples[reply.index].add(reply)
            if reply.finished:
                unfinished -= 1
                if unfinished == 0:
                    return
            reply = await stream.next()

    async def _stream(
        self,
        request: web.Request,
        stream: ReplyStream,
        first: GenerateChunk | None,
        samples: list[_Sample],
        rid: str,
        started: float,
        logprobs: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        n = len(samples)
        try:
            reply: ErrorReply | GenerateChunk = first if first is not None else await stream.next()
            unfinished = n
            while True:
                if isinstance(reply, ErrorReply):
                    await response.write(b"data: " + msgspec.json.encode(_reply_error(reply).body()) + b"\n\n")
                    break
                sample = samples[reply.index]
                sample.add(reply)
                event = sample.answer(rid, reply.index, started, logprobs, n)
                await response.write(b"data: " + msgspec.json.encode(event) + b"\n\n")
                if reply.finished:
                    unfinished -= 1
                    if unfinished == 0:
                        break
                reply = await stream.next()
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away: closing the stream aborts the request
        return response
