"""Defaults as users expect, and vLLM's small routes, on a TokenizerService with a fake scheduler:

- sampling fields a request leaves out take the checkpoint's generation_config.json values, over
  HTTP and ZeroMQ alike; the request's own values win; `--generation-config vllm` ignores the file;
- an omitted max_tokens is generation_config.json's max_new_tokens, else the room left in the context;
- /tokenize, /detokenize, /version (vLLM's shapes, behind the API key);
- CORS with --allowed-origins (none by default).
The fake scheduler records each AddRequest: what the front door asked the scheduler for."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from tokenizers import Tokenizer

from himamba.common.client import Client
from himamba.common.messages import AddRequest
from himamba.common.types import CachedTokens, SamplingParams
from himamba.services.tokenizer.generation_defaults import SamplingDefaults, load_generation_defaults
from tests.http_request import HttpResult, free_port, http_request
from tests.tokenizer.fakes import FakeScheduler, running_service, service_config, write_model_dir

KEY = "k-defaults"
CONTEXT = 400
ORIGIN = "https://ui.example"
GENERATION_CONFIG = {
    "_from_model_config": True,
    "do_sample": True,
    "eos_token_id": 0,
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 150,  # more than the old fixed default of 128
    "transformers_version": "5.23.0",
}
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}" + (
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
OVERRIDE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% generation %}>{% endgeneration %}"
FROM_FILE = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
API_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


class Server:
    """A running front door (HTTP and ZeroMQ) and the fake scheduler behind it."""

    def __init__(self, port: int, endpoint: str, scheduler: FakeScheduler):
        self.port = port
        self.endpoint = endpoint
        self.scheduler = scheduler

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> HttpResult:
        hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})}
        data = None if body is None else json.dumps(body).encode()
        return http_request(self.port, method, path, data, hdrs)

    def add_of(self, response: HttpResult) -> AddRequest:
        """The AddRequest the scheduler got for an HTTP generation."""
        assert response.status == 200, response.body
        return self.scheduler.wait_rid(AddRequest, response.json()["id"])


def _sampling(add: AddRequest) -> dict[str, Any]:
    return {f: getattr(add.sampling, f) for f in FROM_FILE}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, demo_tokenizer: Tokenizer) -> Path:
    tok_cfg = {"eos_token": "<|endoftext|>", "chat_template": TEMPLATE}
    out = write_model_dir(tmp_path_factory.mktemp("gencfg"), demo_tokenizer, tok_cfg)
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return out


def _server(model_dir: Path, tokenizer: Tokenizer, **sections: dict[str, Any]) -> Iterator[Server]:
    http = {"port": free_port(), "api_key": KEY, **sections.pop("http", {})}
    cfg = service_config(model_dir, CONTEXT, scheduler={"default_max_tokens": 0}, http=http, **sections)
    scheduler = FakeScheduler(cfg, tokenizer, "ok done", CachedTokens())
    try:
        with running_service(cfg):
            yield Server(cfg.http.port, cfg.endpoints.zmq_endpoint, scheduler)
    finally:
        scheduler.close()


@pytest.fixture(scope="module")
def auto(model_dir: Path, demo_tokenizer: Tokenizer) -> Iterator[Server]:
    """--generation-config auto (the default) and --allowed-origins ORIGIN."""
    yield from _server(model_dir, demo_tokenizer, http={"allowed_origins": ORIGIN})


@pytest.fixture(scope="module")
def plain(model_dir: Path, demo_tokenizer: Tokenizer) -> Iterator[Server]:
    """--generation-config vllm (the file ignored), no CORS, and --chat-template replacing the checkpoint's."""
    yield from _server(model_dir, demo_tokenizer, model={"generation_config": "vllm", "chat_template": OVERRIDE})


# ---------------------------------------------------------------- generation_config.json defaults


def test_left_out_fields_take_generation_config(auto: Server):
    completion = auto.add_of(auto.request("POST", "/v1/completions", {"prompt": "def f(x):"}))
    chat = auto.add_of(auto.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}))
    for add in (completion, chat):
        assert _sampling(add) == FROM_FILE
        assert add.max_tokens == GENERATION_CONFIG["max_new_tokens"]  # max_new_tokens: the max_tokens default


def test_request_values_win(auto: Server):
    mine = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    add = auto.add_of(auto.request("POST", "/v1/completions", {"prompt": "x = 1", "max_tokens": 7, **mine}))
    assert _sampling(add) == mine and add.max_tokens == 7
    some = auto.add_of(auto.request("POST", "/v1/completions", {"prompt": "x = 2", "temperature": 0.2, "top_k": 5}))
    assert _sampling(some) == {**FROM_FILE, "temperature": 0.2, "top_k": 5}


def test_zeromq_requests_take_the_same_defaults(auto: Server):
    """A msgpack client that leaves sampling fields out gets the file's values; one it sends wins,
    even when it equals SamplingParams' own default (greedy temperature 0)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(auto.endpoint)
    try:
        for rid, sampling in (("z-none", {}), ("z-some", {"temperature": 0.0, "top_p": 0.5})):
            request = {"type": "GenerateRequest", "rid": rid, "prompt": "import os", "api_key": KEY}
            if sampling:
                request["sampling"] = sampling
            sock.send(msgspec.msgpack.encode(request))
        left_out = auto.scheduler.wait_rid(AddRequest, "z-none")
        assert _sampling(left_out) == FROM_FILE and left_out.max_tokens == 150
        given = auto.scheduler.wait_rid(AddRequest, "z-some")
        assert _sampling(given) == {**FROM_FILE, "temperature": 0.0, "top_p": 0.5}
    finally:
        ctx.destroy(linger=0)
    # The Python client sends every field it has: its values, not the file's.
    with Client(auto.endpoint, timeout_s=30, api_key=KEY) as client:
        client.generate("import sys", rid="py-client", max_tokens=2)
    assert _sampling(auto.scheduler.wait_rid(AddRequest, "py-client")) == {**API_DEFAULTS, "temperature": 0.0}


def test_generation_config_vllm_ignores_the_file(plain: Server):
    add = plain.add_of(plain.request("POST", "/v1/completions", {"prompt": [5, 6, 7]}))
    assert _sampling(add) == API_DEFAULTS
    # No max_new_tokens either: an omitted max_tokens is all the room the context has left.
    assert add.max_tokens == CONTEXT - 3 > 128


def test_omitted_max_tokens_is_the_room_left(plain: Server):
    prompt = list(range(10, 10 + CONTEXT - 20))
    add = plain.add_of(plain.request("POST", "/v1/completions", {"prompt": prompt, "ignore_eos": True}))
    assert add.max_tokens == 20
    chat = plain.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]})
    add = plain.add_of(chat)
    assert add.max_tokens == CONTEXT - len(add.input_ids) > 128


def test_generation_config_modes(tmp_path: Path, model_dir: Path):
    auto_defaults = load_generation_defaults("auto", model_dir)
    assert auto_defaults.values() == FROM_FILE and auto_defaults.max_tokens == 150
    assert load_generation_defaults("vllm", model_dir) == SamplingDefaults()
    assert load_generation_defaults("auto", tmp_path) == SamplingDefaults()  # a checkpoint without the file
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "max_new_tokens": 9}))
    by_path = load_generation_defaults(str(tmp_path), model_dir)  # PATH: a directory holding one
    assert by_path.values() == {"temperature": 0.3} and by_path.max_tokens == 9
    with pytest.raises(ValueError, match="has no generation_config.json"):
        load_generation_defaults(str(tmp_path / "nowhere"), model_dir)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match="top_p must be in"):
        load_generation_defaults(str(tmp_path), model_dir)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature must be a number"):
        load_generation_defaults(str(tmp_path), model_dir)


def test_fill_keeps_what_the_client_sent():
    defaults = SamplingDefaults(temperature=0.6, top_k=20)
    sent = SamplingParams(temperature=0.0, top_k=0)
    assert defaults.fill(sent, {"temperature"}) == SamplingParams(temperature=0.0, top_k=20)
    assert defaults.fill(sent, {"temperature", "top_k"}) == sent


# ---------------------------------------------------------------- /tokenize, /detokenize, /version


def test_tokenize_prompt_and_messages(auto: Server, demo_tokenizer: Tokenizer):
    r = auto.request("POST", "/tokenize", {"prompt": "def f(x): return x"})
    assert r.status == 200
    body = r.json()
    ids = demo_tokenizer.encode("def f(x): return x", add_special_tokens=True).ids
    assert body == {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids, "token_strs": None}
    messages = [{"role": "user", "content": "hi"}]
    chat = auto.request("POST", "/tokenize", {"messages": messages, "return_token_strs": True}).json()
    text = "<|user|>\nhi<|endoftext|>\n<|assistant|>\n"
    assert chat["tokens"] == demo_tokenizer.encode(text, add_special_tokens=False).ids
    assert "".join(chat["token_strs"]) == "".join(demo_tokenizer.encode(text).tokens)
    # the chat route sends the scheduler exactly these ids
    add = auto.add_of(auto.request("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1}))
    assert add.input_ids == chat["tokens"]
    cont = {"messages": [*messages, {"role": "assistant", "content": "Sure"}], "add_generation_prompt": False}
    opened = auto.request("POST", "/tokenize", {**cont, "continue_final_message": True}).json()
    assert demo_tokenizer.decode(opened["tokens"], skip_special_tokens=False).endswith("<|assistant|>\nSure")


def test_chat_ids_equal_transformers(auto: Server, model_dir: Path):
    """What the server tokenizes for a conversation (the ids chat completions would run) is
    transformers' apply_chat_template, tools and kwargs included."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    messages = [
        {"role": "system", "content": "Ünïcode <b>"},
        {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]},
    ]
    flat = [messages[0], {"role": "user", "content": "two\nparts"}]  # text parts joined, as vLLM does
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    body = {"messages": messages, "tools": tools, "chat_template_kwargs": {"enable_thinking": False}}
    ours = auto.request("POST", "/tokenize", body).json()["tokens"]
    expected = hf.apply_chat_template(
        flat, tools=tools, add_generation_prompt=True, enable_thinking=False, tokenize=True, return_dict=False
    )
    assert ours == list(expected)


def test_chat_template_flag_replaces_the_checkpoints(plain: Server, demo_tokenizer: Tokenizer):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    ids = plain.request("POST", "/tokenize", body).json()["tokens"]
    assert demo_tokenizer.decode(ids, skip_special_tokens=False) == "[user] hi\n>"


def test_tokenize_refusals(auto: Server):
    both = auto.request("POST", "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
    assert both.status == 400 and "exactly one" in both.json()["error"]["message"]
    bad = auto.request("POST", "/tokenize", {"prompt": 5})
    assert bad.status == 400 and bad.json()["error"]["param"] == "prompt"
    wrong_model = auto.request("POST", "/tokenize", {"prompt": "a", "model": "other"})
    assert wrong_model.status == 404
    cont = {"messages": [{"role": "user", "content": "b"}], "continue_final_message": True}
    assert auto.request("POST", "/tokenize", cont).status == 400  # with add_generation_prompt (default true)


def test_detokenize_round_trips(auto: Server, demo_tokenizer: Tokenizer):
    text = "héllo <|endoftext|> wörld"
    ids = demo_tokenizer.encode(text, add_special_tokens=False).ids
    r = auto.request("POST", "/detokenize", {"tokens": ids})
    assert r.status == 200 and r.json() == {"prompt": text}  # special tokens kept, as vLLM's
    vocab = demo_tokenizer.get_vocab_size(with_added_tokens=True)
    out_of_range = auto.request("POST", "/detokenize", {"tokens": [1, vocab]})
    assert out_of_range.status == 400 and out_of_range.json()["error"]["param"] == "tokens"


def test_version_and_the_key(auto: Server):
    import importlib.metadata

    r = auto.request("GET", "/version")
    assert r.status == 200 and r.json() == {"version": importlib.metadata.version("himamba")}
    for method, path, body in (("GET", "/version", None), ("POST", "/tokenize", {"prompt": "a"})):
        data = None if body is None else json.dumps(body).encode()
        no_key = http_request(auto.port, method, path, data, {"Content-Type": "application/json"})
        assert no_key.status == 401, path
    assert http_request(auto.port, "GET", "/health").status in (200, 503)  # still open, no key


# ---------------------------------------------------------------- CORS


def test_cors_allowed_origin(auto: Server):
    preflight = http_request(
        auto.port,
        "OPTIONS",
        "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status == 200  # answered without the key: browsers send none on a preflight
    assert preflight.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert preflight.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    r = auto.request("GET", "/v1/models", headers={"Origin": ORIGIN})
    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "Origin" in r.headers.get("Vary", "")
    # errors and streams carry it too
    assert (
        auto.request("GET", "/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer no"}).headers[
            "Access-Control-Allow-Origin"
        ]
        == ORIGIN
    )
    stream = auto.request("POST", "/v1/completions", {"prompt": "a", "stream": True}, headers={"Origin": ORIGIN})
    assert stream.status == 200 and stream.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert stream.body.endswith(b"data: [DONE]\n\n")


def test_cors_other_origin_and_no_origin(auto: Server):
    other = "https://evil.example"
    preflight = http_request(
        auto.port, "OPTIONS", "/v1/completions", headers={"Origin": other, "Access-Control-Request-Method": "POST"}
    )
    assert preflight.status == 400 and "Access-Control-Allow-Origin" not in preflight.headers
    r = auto.request("GET", "/v1/models", headers={"Origin": other})
    assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
    assert "Access-Control-Allow-Origin" not in auto.request("GET", "/v1/models").headers


def test_no_cors_by_default(plain: Server):
    preflight = http_request(
        plain.port, "OPTIONS", "/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    )
    # not answered as a preflight: the API key is checked (then OPTIONS is not a method of the route)
    assert preflight.status == 401 and "Access-Control-Allow-Origin" not in preflight.headers
    r = plain.request("GET", "/v1/models", headers={"Origin": ORIGIN})
    assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
