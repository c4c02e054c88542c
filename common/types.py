"""Small values shared by every service and the client: sampling parameters, usage, tiers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import msgspec

Tier = Literal["device", "host", "storage"]
FinishReason = Literal["stop", "length", "abort", "error"]
MAX_SAMPLES = 16  # the most samples (`n`) one request may ask for
# Below this a temperature divides logits into infinities (softmax then gives NaN): 0 is greedy.
MIN_TEMPERATURE = 1e-5
# Device state slots one sample holds from its admission on, per --mamba-scheduler-strategy: its
# working slot and the track slots the strategy keeps beside it. The n samples of one request are
# admitted together (the first reserves its siblings'), so n x this must fit the pool at once.
STATE_SLOTS_PER_SAMPLE = {"no_buffer": 1, "extra_buffer": 3, "extra_buffer_lazy": 2, "single_buffer": 2}
# The sampler compares top_p in float32: a smaller top_p becomes 0 (or a denormal) there.
MIN_TOP_P = 2.0**-126  # float32's smallest normal number, about 1.2e-38
# A penalty divides or multiplies logits: outside this range it overflows them the same way.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_TOP_K = 2**31 - 1
# The hard ceiling of alternatives per token (top_logprobs, prompt_logprobs); a server's
# `--max-logprobs` (default 20) is what its front door allows.
MAX_LOGPROBS = 1024
# Stop strings are matched on every streamed token: their number and size are bounded so a
# request cannot make the front door's per-token work large (matching is O(longest stop)).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all stop strings together
# OpenAI's limits on logit_bias: each value in [-100, 100], at most 300 tokens (the worker's
# static bias buffers are this wide: worker/logit_bias.py).
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = (-100.0, 100.0)
_SEED_MIN = -(2**63)
_SEED_MAX = 2**63 - MAX_SAMPLES


GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf"]


class GrammarSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A constraint on the generated text (structured outputs). `spec` is the kind's source:
    a JSON schema as JSON text (`json_schema`; empty for `json_object`), a regular expression,
    a JSON list of strings (`choice`) or an EBNF/GBNF grammar (`ebnf`)."""

    kind: GrammarKind
    spec: str = ""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to pick tokens and when to stop. `temperature == 0` means greedy."""

    max_tokens: int | None = None  # None: the server's default
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    n: int = 1  # samples of the same prompt; the siblings reuse the first one's prefill via the cache
    logprobs: bool = False
    # With logprobs: the most likely alternatives of each sampled token, this many (by token id).
    top_logprobs: int = 0
    # The prompt tokens' logprobs (from the second token on), each with this many alternatives;
    # None: not asked. Such a request skips the prefix cache: every prompt position is recomputed.
    prompt_logprobs: int | None = None
    grammar: GrammarSpec | None = None  # structured outputs: the text must match it
    # token id -> added to its logit before penalties, grammar and sampling (OpenAI's logit_bias)
    logit_bias: dict[int, float] = {}

    @property
    def penalised(self) -> bool:
        """Whether a repetition, frequency or presence penalty applies (the worker then keeps the
        sequence's token counts)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, max_context_len: int) -> None:
        """Raise ValueError naming the first field that is out of range: every accepted value
        samples (no infinity or NaN can come out of the sampler's arithmetic)."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        if self.max_tokens is not None and not (1 <= self.max_tokens <= max_context_len):
            raise ValueError(f"max_tokens must be in [1, {max_context_len}], got {self.max_tokens}")
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, 100], got {self.temperature}")
        if not (MIN_TOP_P <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be in [{MIN_TOP_P:.3g}, 1], got {self.top_p}")
        if not (0 <= self.top_k <= MAX_TOP_K):
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}], got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not (low <= self.repetition_penalty <= high):
            raise ValueError(f"repetition_penalty must be in [{low}, {high}], got {self.repetition_penalty}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        # Sample i of an n > 1 request samples with seed + i: that must still fit the wire's int64.
        if self.seed is not None and not (_SEED_MIN <= self.seed <= _SEED_MAX):
            raise ValueError(f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed}")
        if not (1 <= self.n <= MAX_SAMPLES):
            raise ValueError(f"n must be in [1, {MAX_SAMPLES}], got {self.n}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if sum(len(s) for s in self.stop) > MAX_STOP_CHARS:
            raise ValueError(f"stop: the stop strings may hold {MAX_STOP_CHARS} characters in all")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_STRINGS} ids, got {len(self.stop_token_ids)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be >= 0")
        if not (0 <= self.top_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        low, high = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise ValueError(f"logit_bias: token id {token} is negative")
            if not (math.isfinite(bias) and low <= bias <= high):
                raise ValueError(f"logit_bias[{token}]: {bias} is out of range [{low:g}, {high:g}]")
        if self.grammar is not None and self.ignore_eos:
            # A finished grammar allows only the end-of-sequence token: ignoring it never ends.
            raise ValueError("ignore_eos cannot be combined with a grammar (structured outputs end on EOS)")


class CachedTokens(msgspec.Struct, frozen=True, kw_only=True):
    """Prompt tokens that were not computed because a cache tier held them."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: CachedTokens = CachedTokens()


def combined_usage(usages: Sequence[Usage]) -> Usage:
    """The usage of one request's samples (in index order): the prompt counted once, with the
    cached tokens of its one real lookup (the first sample's), completion tokens summed."""
    if not usages:
        raise ValueError("usages must be non-empty")
    first = usages[0]
    return Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_tokens=first.cached_tokens,
    )
