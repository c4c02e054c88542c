"""Nothing silently ignored: a request field the body does not define is a 400 naming it, as
OpenAI answers ("Unrecognized request argument supplied"), except the OpenAI fields listed here,
which we accept without effect (their types still checked), and sglang's extension fields that
sglang-router adds at their defaults (accepted at the value that is what we do).

The known fields are the body Struct's own (bodies.py), so a field added there is accepted with
no change here. The lists below are what docs/api/http.md lists.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from himamba.services.tokenizer.http.errors import ApiError


class CompletionNoEffect(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """OpenAI /v1/completions fields accepted without effect."""

    user: str | None = None  # an end-user id for abuse monitoring: we do none
    # sglang's, at the values of ONLY_AT
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_hidden_states: bool = False


class ResponsesNoEffect(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """OpenAI /v1/responses fields accepted without effect (and chat's, below)."""

    user: str | None = None  # an end-user id for abuse monitoring: we do none
    safety_identifier: str | None = None  # the same, OpenAI's newer name
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None  # one tier here
    prompt_cache_key: str | None = None  # OpenAI's cache routing hint: our prefix cache needs none
    prompt_cache_retention: str | None = None  # OpenAI's cache lifetime: ours is bounded by memory


class ChatNoEffect(ResponsesNoEffect, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """OpenAI /v1/chat/completions fields accepted without effect."""

    metadata: dict[str, str] | None = None  # tags for OpenAI's stored completions: nothing is stored
    store: bool | None = None  # store the completion at OpenAI: nothing is stored
    modalities: list[Literal["text"]] | None = None  # text is the only output; ["audio"] is a 400
    # sglang's, at the values of ONLY_AT
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    return_hidden_states: bool = False


# sglang's extension fields, which sglang-router writes at their defaults into every OpenAI body it
# forwards (a fleet must not break on them): accepted at the value that means what himamba does,
# a 400 saying so at any other.
ONLY_AT: dict[str, tuple[object, str]] = {
    "no_stop_trim": (False, "stop strings are always trimmed from the text"),
    "skip_special_tokens": (True, "special tokens are always skipped (the markup output parsers read is kept)"),
    "spaces_between_special_tokens": (True, "special tokens are skipped, so there is nothing to space"),
    "separate_reasoning": (True, "reasoning is split out whenever --reasoning-parser is on"),
    "stream_reasoning": (True, "reasoning streams as it is generated"),
    "return_hidden_states": (False, "hidden states are not returned"),
}


# By body type name, so bodies.py need not import this module's types.
_NO_EFFECT: dict[str, type[msgspec.Struct]] = {
    "CompletionBody": CompletionNoEffect,
    "ChatBody": ChatNoEffect,
    "ResponsesBody": ResponsesNoEffect,
}


def no_effect_fields(body_type: type[msgspec.Struct]) -> tuple[str, ...]:
    """The fields of `body_type`'s requests that are accepted without effect."""
    extra = _NO_EFFECT.get(body_type.__name__)
    return extra.__struct_fields__ if extra is not None else ()


def check_fields(obj: dict[str, Any], body_type: type[msgspec.Struct]) -> dict[str, Any]:
    """`obj` without the no-effect fields (checked); a 400 naming the first field neither defines."""
    known = set(body_type.__struct_encode_fields__)
    extra_type = _NO_EFFECT.get(body_type.__name__)
    extra = set(extra_type.__struct_encode_fields__) - known if extra_type is not None else set()
    for name in obj:
        if name not in known and name not in extra:
            raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name, code="unknown_field")
    if not extra.intersection(obj):
        return obj
    assert extra_type is not None
    try:
        msgspec.convert({k: v for k, v in obj.items() if k in extra}, extra_type)
    except msgspec.ValidationError as e:
        text = str(e)
        param = text.rsplit("`$.", 1)[1].rstrip("`").split("[", 1)[0].split(".", 1)[0] if "`$." in text else None
        raise ApiError(400, f"invalid request: {text}", param=param, code="invalid_type") from None
    for name, (allowed, why) in ONLY_AT.items():
        if name in obj and name in extra and obj[name] != allowed:
            raise ApiError(400, f"{name} must be {json.dumps(allowed)}: {why}", param=name)
    return {k: v for k, v in obj.items() if k not in extra}
