"""Check a client's GenerateRequest and turn it into what the scheduler needs (token ids, budget)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from tokenizers import Tokenizer

from himamba.common.messages import GenerateRequest
from himamba.common.types import SamplingParams

# A prompt longer than this many characters per context token is refused before it is tokenized
# (tokenizing runs on the front door's event loop): no tokenizer packs more into a token.
MAX_CHARS_PER_TOKEN = 32
# Logprob entries (a token and each of its alternatives) one request's replies may carry in all,
# over its n samples and its batched prompts: each is about 70 bytes of JSON, built on the front door's event loop. Turn 3
# sent prompt_logprobs 20 x n 16 x 4,000 prompt tokens (1.3M entries): a 95 MB reply, 3.7 s of loop.
MAX_LOGPROB_ENTRIES = 200_000


class PreparedRequest(NamedTuple):
    """A request that passed every check."""

    input_ids: list[int]
    max_tokens: int  # resolved against the server default and the room left in the context
    prompt_was_text: bool  # then the first chunk carries the prompt's token ids


class RequestLimits(NamedTuple):
    vocab_size: int
    max_context_len: int
    default_max_tokens: int  # 0: up to the context length
    max_logprobs: int = 20  # alternatives per token a request may ask for (--max-logprobs)


def prepare_request(req: GenerateRequest, tokenizer: Tokenizer, limits: RequestLimits) -> PreparedRequest:
    """Validate `req` and tokenize its prompt; raise ValueError naming the offending field."""
    if (req.prompt is None) == (req.input_ids is None):
        raise ValueError("exactly one of prompt and input_ids must be given")
    if req.prompt is not None:
        if not req.prompt:
            raise ValueError("prompt must be non-empty")
        if len(req.prompt) > MAX_CHARS_PER_TOKEN * limits.max_context_len:
            raise ValueError(
                f"prompt has {len(req.prompt)} characters: more than max_context_len {limits.max_context_len} "
                f"tokens can hold ({MAX_CHARS_PER_TOKEN} characters per token at most)"
            )
        # add_special_tokens=True applies the tokenizer's post-processor (e.g. a BOS) when it has one.
        input_ids = tokenizer.encode(req.prompt, add_special_tokens=True).ids
        if not input_ids:
            raise ValueError("prompt tokenizes to no tokens")
    else:
        assert req.input_ids is not None
        input_ids = list(req.input_ids)
        if not input_ids:
            raise ValueError("input_ids must be non-empty")
        if len(input_ids) + 1 > limits.max_context_len:  # before looking at each id
            raise ValueError(
                f"prompt has {len(input_ids)} tokens; max_context_len {limits.max_context_len} leaves no room to generate"
            )
        for i, t in enumerate(input_ids):
            if not (0 <= t < limits.vocab_size):
                raise ValueError(f"input_ids[{i}] = {t} is out of range [0, {limits.vocab_size})")
    sampling = req.sampling
    sampling.validate(limits.max_context_len)
    for name in ("top_logprobs", "prompt_logprobs"):
        k = getattr(sampling, name)
        if k is not None and k > limits.max_logprobs:
            raise ValueError(f"{name}: at most {limits.max_logprobs} (--max-logprobs) alternatives, got {k}")
    for t in sampling.stop_token_ids:
        if t >= limits.vocab_size:
            raise ValueError(f"stop_token_ids: {t} is out of range [0, {limits.vocab_size})")
    for t in sampling.logit_bias:
        if t >= limits.vocab_size:
            raise ValueError(f"logit_bias: token id {t} is out of range [0, {limits.vocab_size})")
    prompt_len = len(input_ids)
    if prompt_len + 1 > limits.max_context_len:
        raise ValueError(
            f"prompt has {prompt_len} tokens; max_context_len {limits.max_context_len} leaves no room to generate"
        )
    max_tokens = resolve_max_tokens(sampling, prompt_len, limits)
    entries = logprob_entries(sampling, prompt_len, max_tokens)
    if entries.total > MAX_LOGPROB_ENTRIES:
        raise ValueError(
            f"the reply would carry {entries.total} logprob entries ({entries.product}), "
            f"more than {MAX_LOGPROB_ENTRIES}: ask for fewer alternatives, samples or tokens"
        )
    return PreparedRequest(input_ids, max_tokens, req.prompt is not None)


def resolve_max_tokens(sampling: SamplingParams, prompt_len: int, limits: RequestLimits) -> int:
    """The token budget of a prompt of `prompt_len` tokens: what it asks for, else the server's
    default, else (0) all the room the context has left, as vLLM; never past the context."""
    wanted = sampling.max_tokens if sampling.max_tokens is not None else limits.default_max_tokens
    wanted = wanted or limits.max_context_len
    return min(wanted, limits.max_context_len - prompt_len)


class LogprobEntries(NamedTuple):
    """How many logprob entries one prompt's replies may carry, over its n samples, and the
    product that gives them (for the message that refuses it)."""

    total: int
    product: str


def logprob_entries(sampling: SamplingParams, prompt_len: int, max_tokens: int) -> LogprobEntries:
    """The prompt's logprobs (every token after the first, in each sample's reply; echo with
    logprobs asks for them too) and the sampled tokens' (by the budget they may reach), times n."""
    parts: list[str] = []
    total = 0
    if sampling.prompt_logprobs is not None:
        total += (prompt_len - 1) * (sampling.prompt_logprobs + 1) * sampling.n
        parts.append(f"prompt_logprobs: {prompt_len - 1} tokens x {sampling.prompt_logprobs + 1}")
    if sampling.logprobs:
        total += max_tokens * (sampling.top_logprobs + 1) * sampling.n
        parts.append(f"logprobs: max_tokens {max_tokens} x {sampling.top_logprobs + 1}")
    return LogprobEntries(total, f"{' + '.join(parts)}, each times n {sampling.n}" if parts else "none")


def check_batch_reply_size(sampling: SamplingParams, prompt_lens: Sequence[int], limits: RequestLimits) -> None:
    """ValueError naming the sum when a batch of prompts (one request each, one reply) would carry
    more than MAX_LOGPROB_ENTRIES logprob entries in all: each prompt may be under the bound alone
    (an lm-eval batch of 64 x 1,000 tokens with echo and logprobs 5 was a 22.8 MB reply)."""
    if sampling.prompt_logprobs is None and not sampling.logprobs:
        return
    per_prompt = [logprob_entries(sampling, n, resolve_max_tokens(sampling, n, limits)) for n in prompt_lens]
    total = sum(e.total for e in per_prompt)
    if total > MAX_LOGPROB_ENTRIES:
        biggest = max(per_prompt, key=lambda e: e.total)
        raise ValueError(
            f"the reply to these {len(prompt_lens)} prompts would carry {total} logprob entries in all (the "
            f"largest prompt's: {biggest.product}), more than {MAX_LOGPROB_ENTRIES}: send fewer prompts per "
            "request, or ask for fewer alternatives, samples or tokens"
        )
