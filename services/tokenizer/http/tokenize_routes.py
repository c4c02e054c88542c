"""POST /tokenize, POST /detokenize, GET /version in vLLM's shapes, and the chat rendering they
share with /v1/chat/completions.

/tokenize takes `{prompt, add_special_tokens=true}` or `{messages, add_generation_prompt,
continue_final_message, tools, documents, chat_template_kwargs, add_special_tokens=false}` and
answers `{count, max_model_len, tokens, token_strs}` (`token_strs` with `return_token_strs`).
/detokenize takes `{tokens}` and answers `{prompt}` (special tokens kept, as vLLM's).
/version answers `{"version": ...}`.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import msgspec
from tokenizers import Tokenizer

from himamba.services.tokenizer.http.bodies import chat_messages_of
from himamba.services.tokenizer.http.chat_template import ChatTemplate, TemplateError
from himamba.services.tokenizer.http.errors import ApiError
from himamba.services.tokenizer.prepare import MAX_CHARS_PER_TOKEN


class TokenizeBody(msgspec.Struct, frozen=True, kw_only=True):
    """POST /tokenize: a prompt, or a conversation rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, frozen=True, kw_only=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int]


def render_chat(
    template: ChatTemplate | None,
    max_context_len: int,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict[str, Any]] | None,
    documents: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None,
) -> str:
    """The prompt text of a conversation, checked to fit the context before it is tokenized."""
    if template is None:
        raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
    try:
        text = template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            extra=chat_template_kwargs,
        )
    except TemplateError as e:
        raise ApiError(400, str(e), param="messages") from None
    if len(text) > MAX_CHARS_PER_TOKEN * max_context_len:  # checked before tokenizing
        raise ApiError(
            400,
            f"messages render to {len(text)} characters: more than max_context_len {max_context_len} "
            f"tokens can hold ({MAX_CHARS_PER_TOKEN} characters per token at most)",
            param="messages",
        )
    return text


def tokenize(
    body: TokenizeBody, template: ChatTemplate | None, tokenizer: Tokenizer, max_context_len: int
) -> dict[str, Any]:
    """The /tokenize answer."""
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        text = render_chat(
            template,
            max_context_len,
            chat_messages_of(body.messages),
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=body.tools,
            documents=body.documents,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        add_special = bool(body.add_special_tokens)
    else:
        assert body.prompt is not None
        text = body.prompt
        if len(text) > MAX_CHARS_PER_TOKEN * max_context_len:
            raise ApiError(
                400,
                f"prompt has {len(text)} characters: more than max_context_len {max_context_len} tokens can hold",
                param="prompt",
            )
        add_special = body.add_special_tokens is not False
    encoding = tokenizer.encode(text, add_special_tokens=add_special)
    return {
        "count": len(encoding.ids),
        "max_model_len": max_context_len,
        "tokens": encoding.ids,
        "token_strs": list(encoding.tokens) if body.return_token_strs else None,
    }


def detokenize(body: DetokenizeBody, tokenizer: Tokenizer, vocab_size: int) -> dict[str, Any]:
    """The /detokenize answer; an id outside the vocabulary is a 400 naming it."""
    for i, t in enumerate(body.tokens):
        if not 0 <= t < vocab_size:
            raise ApiError(400, f"tokens[{i}] = {t} is out of range [0, {vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


def version() -> dict[str, str]:
    """The /version answer: this package's version."""
    try:
        return {"version": importlib.metadata.version("himamba")}
    except importlib.metadata.PackageNotFoundError:
        return {"version": "unknown"}
