"""`previous_response_id` as an exact extension of the stored conversation's token ids.

A stored response keeps the token ids its turn ran on: its prompt followed by its output, as
generated (the model's own text and tool-call markup, not a re-rendering of them). The next turn's
prompt is those ids, then the end of the stored assistant turn as the chat template writes it,
then the new input rendered as the next turn:

- the template renders the stored conversation (its messages, the output as an assistant turn)
  without a generation prompt (`r0`), and with the new messages and a generation prompt (`r1`);
  `r1[len(r0):]` is the new turn's text;
- the end of the stored turn: if its output ended with a special token that the template writes
  after an assistant turn (the model closed its turn: `<|im_end|>`, `<|endoftext|>`), what `r0`
  has after that token's last occurrence (a newline, say); otherwise (cut by max_output_tokens, a
  stop string) what `r0` has from the last occurrence of its `eos_token` on, that token included;
- those two texts are tokenized together and appended to the stored ids.

The earlier turns are then token for token what the engine computed, so the prefix cache holds
them (up to its page granularity: the recurrent state is checkpointed at page boundaries). When the
template cannot extend the conversation that way (`r1` does not start with `r0`, as templates
that drop past thinking do; the tools or instructions differ from the stored turn's; no end of
turn is found) the whole conversation is rendered instead, as a first turn would be.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from tokenizers import Tokenizer

Render = Callable[[list[dict[str, Any]], bool], str]  # (messages, add_generation_prompt) -> text


class StoredTokens(NamedTuple):
    """A stored turn as the engine ran it."""

    ids: list[int]  # its prompt's ids, then its output's
    messages: list[dict[str, Any]]  # the same conversation as chat messages (the output last)
    tools: list[dict[str, Any]] | None  # the chat tools its template saw
    instructions: str | None


def continued_ids(
    stored: StoredTokens,
    new_messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    instructions: str | None,
    render: Render,
    tokenizer: Tokenizer,
    eos_token: str | None,
) -> list[int] | None:
    """The next turn's prompt ids (see the module's docstring); None: render the whole conversation."""
    if tools != stored.tools or instructions != stored.instructions or not stored.ids:
        return None
    r0 = render(stored.messages, False)
    r1 = render([*stored.messages, *new_messages], True)
    if not r1.startswith(r0):
        return None
    closing = _end_of_turn(r0, stored.ids[-1], tokenizer, eos_token)
    if closing is None:
        return None
    return [*stored.ids, *tokenizer.encode(closing + r1[len(r0) :], add_special_tokens=False).ids]


def _end_of_turn(r0: str, last_id: int, tokenizer: Tokenizer, eos_token: str | None) -> str | None:
    """The text that closes the stored assistant turn after its last generated token."""
    added = tokenizer.get_added_tokens_decoder().get(last_id)
    if added is not None and added.special and added.content in r0:
        return r0[r0.rindex(added.content) + len(added.content) :]
    if eos_token and eos_token in r0:
        return r0[r0.rindex(eos_token) :]
    return None
