"""`--reasoning-parser`: splits `<think>...</think>` out of an answer into `reasoning_content`.

- `qwen3`: the answer thinks only when it opens with `<think>` (after optional whitespace) —
  or when the prompt already opened it: templates of thinking models (Qwen3-Next Thinking,
  Nemotron Nano v2 / 3) end the prompt with `<think>\\n`, and `enable_thinking: false` closes it
  there (`<think></think>`), which the prompt shows too.
- `deepseek_r1`: the answer thinks from its first token unless it opens with `<think>` itself
  (the tag is then dropped); only `</think>` ends the thinking.

Reasoning runs until `</think>`; an answer cut short while thinking is all reasoning. Whitespace
right after `</think>` is not content. The same text splits the same way however it streams.
"""

from __future__ import annotations

from himamba.services.tokenizer.tool_parsers.events import Event, Reasoning, Text, held_prefix

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def prompt_opened_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open `<think>` (the answer starts thinking)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


class ThinkParser:
    """A StreamParser: Reasoning events until `</think>`, Text after it."""

    def __init__(self, kind: str, prompt_opened: bool):
        if kind not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {kind!r} (known: {', '.join(REASONING_PARSERS)})")
        self._kind = kind
        # start: not decided yet (does the answer open <think>?); think; lead (whitespace after
        # </think>); content
        self._state = "think" if prompt_opened else "start"
        self._pending = ""

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._pending += text
        while self._pending:
            if self._state == "start":
                head = self._pending.lstrip()
                if head.startswith(THINK_OPEN):
                    self._pending = head[len(THINK_OPEN) :]
                    self._state = "think"
                elif not head or THINK_OPEN.startswith(head):
                    return out  # whitespace, or the tag arriving
                else:
                    self._state = "think" if self._kind == "deepseek_r1" else "content"
            elif self._state == "think":
                k = self._pending.find(THINK_CLOSE)
                if k < 0:
                    keep = held_prefix(self._pending, THINK_CLOSE)
                    if len(self._pending) > keep:
                        out.append(Reasoning(self._pending[: len(self._pending) - keep]))
                    self._pending = self._pending[len(self._pending) - keep :]
                    return out
                if k:
                    out.append(Reasoning(self._pending[:k]))
                self._pending = self._pending[k + len(THINK_CLOSE) :]
                self._state = "lead"
            elif self._state == "lead":
                self._pending = self._pending.lstrip()
                if self._pending:
                    self._state = "content"
            else:
                out.append(Text(self._pending))
                self._pending = ""
        return out

    def finish(self) -> list[Event]:
        pending, self._pending = self._pending, ""
        if not pending or self._state == "lead":
            return []
        if self._state == "think" or (self._state == "start" and self._kind == "deepseek_r1"):
            return [Reasoning(pending)]
        return [Text(pending)]
