"""The OpenAI request bodies we accept, and their translation into a `GenerateRequest`.

Fields follow OpenAI's API, plus the extensions vLLM users rely on: `ignore_eos`, `top_k`,
`min_p`, `repetition_penalty`, `stop_token_ids`, `return_token_ids`, `prompt_logprobs`,
`return_tokens_as_token_ids`, and vLLM's and sglang's structured-output fields. A field no body
defines is a 400 naming it, as OpenAI answers, except the OpenAI fields accepted without effect
(unknown_fields.py). Types are checked here (the error names the field); ranges are checked by
the same code that checks ZeroMQ requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import msgspec

from himamba.common.types import MAX_SAMPLES, SamplingParams
from himamba.services.tokenizer.http.errors import ApiError
from himamba.services.tokenizer.http.logprobs_json import LogprobsAsk
from himamba.services.tokenizer.http.structured_outputs import StructuredOutputFields, grammar_of
from himamba.services.tokenizer.http.unknown_fields import check_fields


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = False  # OpenAI pads events against side channels; accepted without effect


class _Body(StructuredOutputFields, frozen=True, kw_only=True):
    """Fields common to /v1/completions and /v1/chat/completions (with the structured-output
    fields of `structured_outputs.py`)."""

    model: str | None = None
    max_tokens: int | None = None
    # Sampling fields left out (None) take generation_config.json's default, else the API's.
    temperature: float | None = None  # None: OpenAI's default 1.0
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # extensions (vLLM's names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False


class CompletionBody(_Body, frozen=True, kw_only=True):
    """POST /v1/completions."""

    prompt: str | list[Any]
    logprobs: int | None = None  # k: the chosen tokens' logprobs and the k most likely
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatBody(_Body, frozen=True, kw_only=True):
    """POST /v1/chat/completions. `messages` stay plain JSON: the chat template reads them."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # extension (vLLM)
    continue_final_message: bool = False  # extension (vLLM)
    documents: list[dict[str, Any]] | None = None  # extension (vLLM): for RAG templates
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM)


def decode_body(raw: bytes, body_type: type[msgspec.Struct]) -> tuple[Any, dict[str, Any]]:
    """Parse a JSON body into `body_type`; returns (typed body, the plain JSON object)."""
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec raises the latter for bad UTF-8
        raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        body = msgspec.convert(check_fields(obj, body_type), body_type)
    except RecursionError:
        raise ApiError(400, "invalid request: nested too deeply", code="invalid_type") from None
    except msgspec.ValidationError as e:
        text = str(e)
        param = text.rsplit("`$.", 1)[1].rstrip("`") if "`$." in text else None
        if param is not None:
            param = param.split("[", 1)[0].split(".", 1)[0]
        missing = "Object missing required field `"
        if text.startswith(missing):
            param = text[len(missing) :].split("`", 1)[0]
        raise ApiError(400, f"invalid request: {text}", param=param, code="invalid_type") from None
    # Checked before anything sized by n is built: a huge n must be a 400, not an allocation.
    n = getattr(body, "n", 1)
    if not 1 <= n <= MAX_SAMPLES:
        raise ApiError(400, f"n must be in [1, {MAX_SAMPLES}], got {n}", param="n")
    return body, obj


def _check_common(body: _Body) -> None:
    logit_bias_of(body.logit_bias)


# A logit_bias key longer than this is no token id (and past 4,300 digits int() refuses to parse it).
_MAX_ID_DIGITS = 18


def logit_bias_of(raw: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as strings) as token ids; its size and values are checked
    with the other sampling ranges (`SamplingParams.validate`), its ids against the vocabulary."""
    out: dict[int, float] = {}
    keys: dict[int, str] = {}
    for key, value in (raw or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise ApiError(400, f"logit_bias: keys are token ids, got {key!r}", param="logit_bias")
        if len(key) > _MAX_ID_DIGITS:  # no vocabulary is this large; int() of it may not even parse
            shown = key if len(key) <= 24 else f"{key[:20]}... ({len(key)} digits)"
            raise ApiError(400, f"logit_bias: token id {shown} is out of range", param="logit_bias")
        token = int(key)
        if token in keys:  # "5" and "05": one of the two biases would be dropped unseen
            raise ApiError(
                400, f"logit_bias: keys {keys[token]!r} and {key!r} are the same token id {token}", param="logit_bias"
            )
        keys[token] = key
        out[token] = float(value)
    return out


def _stops(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# The API's default for a sampling field a body leaves out, when generation_config.json has none
# (OpenAI's, vLLM's and sglang's agree on these).
API_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def sampling_of(
    body: _Body,
    max_tokens: int | None,
    logprobs: bool,
    defaults: Mapping[str, float | int] | None = None,
    ask: LogprobsAsk | None = None,
) -> SamplingParams:
    """The SamplingParams a body asks for (ranges are checked later, with ZeroMQ requests'); a
    sampling field it leaves out takes `defaults` (generation_config.json's), else the API's."""
    ask = ask if ask is not None else LogprobsAsk(logprobs)
    chosen = {**API_DEFAULTS, **(defaults or {})}
    for name in API_DEFAULTS:
        if (value := getattr(body, name)) is not None:
            chosen[name] = value
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(chosen["temperature"]),
        top_p=float(chosen["top_p"]),
        top_k=int(chosen["top_k"]),
        min_p=float(chosen["min_p"]),
        seed=body.seed,
        stop=_stops(body.stop),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        repetition_penalty=float(chosen["repetition_penalty"]),
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        n=body.n,
        logprobs=logprobs,
        top_logprobs=ask.top,
        prompt_logprobs=ask.prompt_logprobs,
        grammar=grammar_of(body),
        logit_bias=logit_bias_of(body.logit_bias),
    )


class CompletionPrompt(NamedTuple):
    """A completion prompt: text, or token ids."""

    text: str | None
    token_ids: list[int] | None


MAX_BATCHED_PROMPTS = 256  # prompts in one /v1/completions request (each becomes a request)


def _token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


def completion_prompts(body: CompletionBody) -> list[CompletionPrompt]:
    """The prompts of a completions body: a string, a list of ids, or a batch (a list of
    strings or of id lists); each becomes a request."""
    prompt: Any = body.prompt
    if isinstance(prompt, str):
        return [CompletionPrompt(prompt, None)]
    if _token_ids(prompt) and prompt:
        return [CompletionPrompt(None, list(prompt))]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _token_ids(p) for p in prompt):
        if len(prompt) * body.n > MAX_BATCHED_PROMPTS:
            raise ApiError(
                400,
                f"prompt: at most {MAX_BATCHED_PROMPTS} prompts times n in one request, got {len(prompt)} x {body.n}",
                param="prompt",
            )
        return [CompletionPrompt(p, None) if isinstance(p, str) else CompletionPrompt(None, list(p)) for p in prompt]
    raise ApiError(
        400, "prompt must be a string, a list of token ids, or a list of strings or of token id lists", param="prompt"
    )


def check_completion(body: CompletionBody) -> LogprobsAsk:
    """Refuse what we do not support; returns the logprobs wanted (`logprobs: k`: the chosen
    tokens' and the k most likely; `echo`: the prompt's too)."""
    _check_common(body)
    if body.best_of not in (None, 1, body.n):  # best_of == n: every sample is returned, nothing to rank
        raise ApiError(400, f"best_of must be 1 or n ({body.n}), got {body.best_of}", param="best_of")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if body.logprobs is not None and body.logprobs < 0:
        raise ApiError(400, f"logprobs must be >= 0, got {body.logprobs}", param="logprobs")
    _check_prompt_logprobs(body)
    return LogprobsAsk(body.logprobs is not None, body.logprobs or 0, body.echo, body.prompt_logprobs)


def _check_prompt_logprobs(body: _Body) -> None:
    if body.prompt_logprobs is not None and body.prompt_logprobs < 0:
        raise ApiError(400, f"prompt_logprobs must be >= 0, got {body.prompt_logprobs}", param="prompt_logprobs")


def chat_logprobs_ask(body: ChatBody) -> LogprobsAsk:
    """The logprobs a chat body wants (`top_logprobs` needs `logprobs: true`, as OpenAI's)."""
    top = body.top_logprobs or 0
    if top < 0:
        raise ApiError(400, f"top_logprobs must be >= 0, got {top}", param="top_logprobs")
    if top and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    _check_prompt_logprobs(body)
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError(400, "prompt_logprobs is not supported with stream", param="prompt_logprobs")
    return LogprobsAsk(body.logprobs, top, False, body.prompt_logprobs)


def _content_text(content: Any, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"messages[{index}].content: only text parts are supported", param="messages")
            parts.append(part["text"])
        return "\n".join(parts)
    raise ApiError(400, f"messages[{index}].content must be a string or a list of text parts", param="messages")


def chat_messages(body: ChatBody) -> list[dict[str, Any]]:
    """The conversation as the template expects it: roles checked, text parts joined into strings."""
    _check_common(body)
    return chat_messages_of(body.messages)


def chat_messages_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as the template expects them: roles checked, text parts joined into strings."""
    if not messages:
        raise ApiError(400, "messages must be non-empty", param="messages")
    out = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"messages[{i}].role must be a non-empty string", param="messages")
        out.append({**msg, "content": _content_text(msg.get("content"), i)})
    return out
