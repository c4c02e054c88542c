"""The next turn's prompt ids as an exact extension of a stored turn's, and the cases where the
template cannot extend it (the conversation is then rendered whole)."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer

from himamba.services.tokenizer.http.chat_template import ChatTemplate
from himamba.services.tokenizer.http.responses_continuation import StoredTokens, continued_ids

SIMPLE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Drops the content of assistant turns before the last user turn, as templates that drop past thinking do.
DROPS_PAST = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|assistant|>\n(earlier)<|endoftext|>\n"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
USER = [{"role": "user", "content": "hi"}]
ANSWER = {"role": "assistant", "content": "hello"}
NEXT = [{"role": "user", "content": "more"}]


def _render(source: str):
    template = ChatTemplate(source, {"eos_token": "<|endoftext|>"})

    def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return template.render(
            messages, add_generation_prompt=generation_prompt, continue_final_message=False, tools=None,
            documents=None, extra=None,
        )  # fmt: skip

    return render


def _stored(tok: Tokenizer, output: str, **kw: Any) -> StoredTokens:
    prompt = _render(SIMPLE)(USER, True)
    ids = tok.encode(prompt, add_special_tokens=False).ids + tok.encode(output, add_special_tokens=False).ids
    return StoredTokens(ids, [*USER, ANSWER], kw.get("tools"), kw.get("instructions"))


def test_an_answer_closed_by_eos_is_extended_by_the_template_s_gap(demo_tokenizer: Tokenizer):
    stored = _stored(demo_tokenizer, "hello<|endoftext|>")
    ids = continued_ids(stored, NEXT, None, None, _render(SIMPLE), demo_tokenizer, "<|endoftext|>")
    assert ids == [*stored.ids, *demo_tokenizer.encode("\n<|user|>\nmore<|endoftext|>\n<|assistant|>\n").ids]


def test_an_answer_cut_short_is_closed_with_the_eos_token(demo_tokenizer: Tokenizer):
    stored = _stored(demo_tokenizer, "hel")
    ids = continued_ids(stored, NEXT, None, None, _render(SIMPLE), demo_tokenizer, "<|endoftext|>")
    closing = demo_tokenizer.encode("<|endoftext|>\n<|user|>\nmore<|endoftext|>\n<|assistant|>\n").ids
    assert ids == [*stored.ids, *closing]


@pytest.mark.parametrize(
    ("template", "tools", "instructions", "eos"),
    [
        (DROPS_PAST, None, None, "<|endoftext|>"),  # the next render is not an extension of this one
        (SIMPLE, [{"type": "function", "function": {"name": "f"}}], None, "<|endoftext|>"),  # other tools
        (SIMPLE, None, "new rules", "<|endoftext|>"),  # other instructions
        (SIMPLE, None, None, "<|im_end|>"),  # no end of turn found
    ],
)
def test_what_the_template_cannot_extend_is_rendered_whole(
    demo_tokenizer: Tokenizer, template: str, tools: Any, instructions: str | None, eos: str
):
    stored = _stored(demo_tokenizer, "hel")
    assert continued_ids(stored, NEXT, tools, instructions, _render(template), demo_tokenizer, eos) is None
