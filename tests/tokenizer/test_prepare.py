"""prepare_request: validation names the field; max_tokens is resolved against the context."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from himamba.common.messages import GenerateRequest
from himamba.common.types import SamplingParams
from himamba.services.tokenizer.prepare import RequestLimits, prepare_request

LIMITS = RequestLimits(vocab_size=2048, max_context_len=100, default_max_tokens=16)


def test_text_prompt_is_tokenized_without_added_special_tokens(demo_tokenizer: Tokenizer) -> None:
    p = prepare_request(GenerateRequest(prompt="def f(x):"), demo_tokenizer, LIMITS)
    assert p.input_ids == demo_tokenizer.encode("def f(x):", add_special_tokens=False).ids
    assert p.prompt_was_text
    assert p.max_tokens == 16


def test_max_tokens_is_capped_by_the_room_left(demo_tokenizer: Tokenizer) -> None:
    ids = list(range(1, 91))
    p = prepare_request(GenerateRequest(input_ids=ids, sampling=SamplingParams(max_tokens=50)), demo_tokenizer, LIMITS)
    assert p.max_tokens == 10
    assert p.input_ids == ids and not p.prompt_was_text
    p = prepare_request(GenerateRequest(input_ids=[1], sampling=SamplingParams(max_tokens=5)), demo_tokenizer, LIMITS)
    assert p.max_tokens == 5


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        (GenerateRequest(), "exactly one of prompt and input_ids"),
        (GenerateRequest(prompt="a", input_ids=[1]), "exactly one of prompt and input_ids"),
        (GenerateRequest(prompt=""), "prompt must be non-empty"),
        (GenerateRequest(input_ids=[]), "input_ids must be non-empty"),
        (GenerateRequest(input_ids=[3, 2048]), "input_ids[1] = 2048"),
        (GenerateRequest(input_ids=[-5]), "input_ids[0] = -5"),
        (GenerateRequest(input_ids=[1] * 100), "max_context_len 100"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(temperature=-1.0)), "temperature"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(max_tokens=101)), "max_tokens"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(stop=[""])), "stop"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(stop_token_ids=[4096])), "stop_token_ids"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(n=0)), "n must be in [1, 16]"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(n=17)), "n must be in [1, 16]"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(seed=2**63 - 1)), "seed must be in"),
        # Values that pass a plain range check but make sampling raise (or overflow the wire).
        (GenerateRequest(prompt="a", sampling=SamplingParams(temperature=1e-40)), "temperature"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(repetition_penalty=1e-40)), "repetition_penalty"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(repetition_penalty=float("nan"))), "repetition_penalty"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(repetition_penalty=float("inf"))), "repetition_penalty"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(temperature=float("inf"))), "temperature"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(top_p=float("nan"))), "top_p"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(min_p=float("nan"))), "min_p"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(presence_penalty=float("-inf"))), "presence_penalty"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(top_k=2**70)), "top_k"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(stop=["x"] * 65)), "stop"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(stop=["x" * 2049, "y" * 2048])), "stop"),
        (GenerateRequest(prompt="a", sampling=SamplingParams(stop_token_ids=[1] * 65)), "stop_token_ids"),
        # Length is checked before the prompt is tokenized or its ids looked at.
        (GenerateRequest(prompt="a" * 3201), "prompt has 3201 characters"),
        (GenerateRequest(input_ids=[-1] * 100), "max_context_len 100"),
    ],
)
def test_bad_requests_raise_value_error_naming_the_field(
    demo_tokenizer: Tokenizer, req: GenerateRequest, needle: str
) -> None:
    with pytest.raises(ValueError) as info:
        prepare_request(req, demo_tokenizer, LIMITS)
    assert needle in str(info.value)


def test_a_prompt_that_fills_the_context_is_refused(demo_tokenizer: Tokenizer) -> None:
    prompt = "x = 1\n" * 200
    with pytest.raises(ValueError, match="leaves no room"):
        prepare_request(GenerateRequest(prompt=prompt), demo_tokenizer, LIMITS)


def test_a_reply_of_more_logprob_entries_than_the_limit_is_refused_with_the_numbers(demo_tokenizer: Tokenizer) -> None:
    from himamba.services.tokenizer.prepare import MAX_LOGPROB_ENTRIES

    limits = RequestLimits(vocab_size=2048, max_context_len=4096, default_max_tokens=16)
    # Turn 3 (N5): prompt_logprobs 20 x n 16 on a 4,000-token prompt became a 95 MB reply.
    big = SamplingParams(max_tokens=8, n=16, temperature=1.0, prompt_logprobs=20)
    with pytest.raises(ValueError, match=r"3999 tokens x 21.*n 16.*more than 200000") as e:
        prepare_request(GenerateRequest(input_ids=[1] * 4000, sampling=big), demo_tokenizer, limits)
    assert str(1_343_664) in str(e.value)  # 3,999 x 21 x 16
    # Sampled logprobs count by the token budget they may reach.
    sampled = SamplingParams(max_tokens=4000, n=16, temperature=1.0, logprobs=True, top_logprobs=20)
    with pytest.raises(ValueError, match="logprobs: max_tokens 4000 x 21"):
        prepare_request(GenerateRequest(input_ids=[1, 2], sampling=sampled), demo_tokenizer, limits)
    # The same asks at a size the limit allows are served, up to it exactly.
    n = MAX_LOGPROB_ENTRIES // (21 * 3999)
    ok = SamplingParams(max_tokens=8, n=n, temperature=1.0, prompt_logprobs=20)
    prepare_request(GenerateRequest(input_ids=[1] * 4000, sampling=ok), demo_tokenizer, limits)
    edge = SamplingParams(max_tokens=MAX_LOGPROB_ENTRIES // 2, logprobs=True, top_logprobs=1)
    prepare_request(GenerateRequest(input_ids=[1, 2], sampling=edge), demo_tokenizer, RequestLimits(2048, 10**6, 0))


def test_a_batch_is_bounded_by_the_sum_of_its_prompts_logprob_entries() -> None:
    from himamba.services.tokenizer.prepare import MAX_LOGPROB_ENTRIES, check_batch_reply_size

    limits = RequestLimits(vocab_size=2048, max_context_len=4096, default_max_tokens=16)
    # Turn 4: an lm-eval batch of 64 x 1,000-token prompts, echo and logprobs 5: 22.8 MB in one reply.
    echo = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=5, prompt_logprobs=5)
    with pytest.raises(ValueError, match=r"these 64 prompts would carry 384000 logprob entries in all"):
        check_batch_reply_size(echo, [1000] * 64, limits)  # 64 x (999 x 6 + 1 x 6)
    check_batch_reply_size(echo, [1000] * (MAX_LOGPROB_ENTRIES // 6000), limits)  # up to the bound: served
    # max_tokens left out counts by the server's default (16 here), as each prompt alone does.
    sampled = SamplingParams(temperature=1.0, logprobs=True, top_logprobs=20)
    check_batch_reply_size(sampled, [10] * 256, limits)  # 256 x 16 x 21 = 86,016
    with pytest.raises(ValueError, match="max_tokens 4086 x 21"):
        check_batch_reply_size(sampled, [10] * 3, RequestLimits(2048, 4096, 0))  # the context: 3 x 4,086 x 21
    check_batch_reply_size(SamplingParams(max_tokens=4000), [4000] * 256, limits)  # no logprobs: nothing to bound
