"""Sampling defaults from the checkpoint's generation_config.json (`--generation-config`, as vLLM's).

A request that leaves out temperature, top_p, top_k, min_p or repetition_penalty gets the
checkpoint's recommended value; one that leaves out max_tokens gets `max_new_tokens`. A value the
request sets always wins. Every value the file states is applied, as vLLM does with transformers 5
(`GenerationConfig.to_diff_dict()` keeps every value set, its defaults being None); `do_sample`
is not read (a request samples unless its temperature is 0). `auto`: the checkpoint's file;
`vllm`: none; otherwise a directory holding a generation_config.json.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import msgspec

from himamba.common.types import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# The sampling fields a generation config may recommend (max_new_tokens aside), integer or not.
_FIELDS = {"temperature": False, "top_p": False, "top_k": True, "min_p": False, "repetition_penalty": False}
SAMPLING_FIELDS = tuple(_FIELDS)


class SamplingDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """What a request gets for each field it leaves out (None: the API's own default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # generation_config.json's max_new_tokens
    source: str = ""  # the file they came from ("" if none)

    def values(self) -> dict[str, float | int]:
        """The sampling fields that have a default (max_tokens aside)."""
        return {f: v for f in SAMPLING_FIELDS if (v := getattr(self, f)) is not None}

    def describe(self) -> str:
        """One log line's worth: the defaults and where they came from."""
        shown = {**self.values(), **({"max_tokens": self.max_tokens} if self.max_tokens is not None else {})}
        if not shown:
            return "sampling defaults: the API's own (no generation_config.json recommendations)"
        fields = ", ".join(f"{k}={v}" for k, v in shown.items())
        return f"sampling defaults from {self.source}: {fields} (a request's values win; --generation-config vllm: none)"

    def fill(self, sampling: SamplingParams, given: Collection[str]) -> SamplingParams:
        """`sampling` with the fields the client did not give (`given`: the keys it sent) set to
        these defaults; max_tokens stays None (resolved against the context by prepare_request)."""
        missing = {f: v for f, v in self.values().items() if f not in given}
        return msgspec.structs.replace(sampling, **missing) if missing else sampling


def _number(value: Any, integer: bool) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if integer:
        return int(value) if float(value).is_integer() else None
    return float(value)


def load_generation_defaults(mode: str, model_dir: str | Path) -> SamplingDefaults:
    """The defaults `--generation-config mode` asks for; ValueError when the file is unreadable
    or holds a value no request could ask for (the message names the file and the field)."""
    if mode == "vllm":
        return SamplingDefaults()
    directory = Path(model_dir) if mode == "auto" else Path(mode).expanduser()
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        if mode != "auto":
            raise ValueError(f"--generation-config: {directory} has no {GENERATION_CONFIG_FILE}")
        return SamplingDefaults()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--generation-config: {path} is not a JSON object")
    found: dict[str, Any] = {}
    for field, integer in _FIELDS.items():
        raw = data.get(field)
        if raw is None:
            continue
        value = _number(raw, integer)
        if value is None:
            raise ValueError(f"--generation-config: {path}: {field} must be a number, got {raw!r}")
        found[field] = value
    raw_max = data.get("max_new_tokens")
    if raw_max is not None:
        max_new = _number(raw_max, integer=True)
        if max_new is None or max_new < 1:
            raise ValueError(f"--generation-config: {path}: max_new_tokens must be a positive integer, got {raw_max!r}")
        found["max_tokens"] = max_new
    defaults = SamplingDefaults(**found, source=str(path))
    try:  # a default no request could set would fail every request that leaves the field out
        SamplingParams(**defaults.values()).validate(max_context_len=2**62)
    except ValueError as e:
        raise ValueError(f"--generation-config: {path}: {e} (--generation-config vllm ignores the file)") from None
    return defaults


class _SentSampling(msgspec.Struct):
    """The keys of a ZeroMQ GenerateRequest's `sampling` map (values not decoded)."""

    sampling: dict[str, msgspec.Raw] = {}


_sent_decoder = msgspec.msgpack.Decoder(_SentSampling)


def sent_sampling_fields(payload: bytes) -> frozenset[str]:
    """The sampling fields a ZeroMQ client put in its request: a decoded SamplingParams cannot tell
    a field left out from one sent with its default value, and only the former takes a default."""
    try:
        return frozenset(_sent_decoder.decode(payload).sampling)
    except msgspec.DecodeError:  # it decoded as a GenerateRequest a moment ago
        return frozenset(SAMPLING_FIELDS)
