"""How a chat answer is read: the server's tool-call and reasoning parsers (resolved once from
the config and the chat template) applied to one request's tool plan and prompt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from himamba.common.config import HttpConfig
from himamba.common.types import SamplingParams
from himamba.services.tokenizer.http.errors import ApiError
from himamba.services.tokenizer.http.tool_choice import ToolPlan, plan_tools
from himamba.services.tokenizer.reasoning_parser import THINK_OPEN, ThinkParser, prompt_opened_thinking
from himamba.services.tokenizer.tool_parsers import call_id_maker, detect_tool_parser, make_tool_parser
from himamba.services.tokenizer.tool_parsers.events import StreamParser
from himamba.services.tokenizer.tool_parsers.forced import NamedCall, RequiredCalls
from himamba.services.tokenizer.tool_parsers.streaming import AnswerShaper


def resolve_tool_parser(setting: str, template_source: str | None) -> str | None:
    """The tool-call format of `--tool-call-parser` (auto: the template's); None: no parser."""
    if setting == "none":
        return None
    if setting == "auto":
        return detect_tool_parser(template_source or "")
    return setting


def resolve_reasoning_parser(setting: str, template_source: str | None) -> str | None:
    """The reasoning parser of `--reasoning-parser` (auto: qwen3 if the template knows <think>)."""
    if setting == "none":
        return None
    if setting == "auto":
        return "qwen3" if THINK_OPEN in (template_source or "") else None
    return setting


class ChatParsing:
    """The server's parsers, and what they make of one chat request."""

    def __init__(self, cfg: HttpConfig, template_source: str | None):
        self.tool_parser = resolve_tool_parser(cfg.tool_call_parser, template_source)
        self.reasoning_parser = resolve_reasoning_parser(cfg.reasoning_parser, template_source)

    def plan(self, tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool) -> ToolPlan:
        """The request's tool fields checked (400s) and resolved."""
        return plan_tools(tools, tool_choice, parallel_tool_calls, self.tool_parser)

    @staticmethod
    def constrain(sampling: SamplingParams, plan: ToolPlan) -> SamplingParams:
        """`sampling` with the grammar that enforces tool_choice required / a named function."""
        if plan.grammar is None:
            return sampling
        if sampling.grammar is not None:
            raise ApiError(
                400,
                f"tool_choice {plan.mode!r} constrains the answer to tool calls: it cannot be combined with "
                "another structured output (response_format, structured_outputs, ...)",
                param="tool_choice",
            )
        return msgspec.structs.replace(sampling, grammar=plan.grammar)

    def shaping(self, plan: ToolPlan, tools: list[Any] | None, prompt_text: str) -> Callable[[], AnswerShaper] | None:
        """A maker of one choice's answer shaper (None: the answer is plain content)."""
        reasoning = self.reasoning_parser
        if plan.mode == "none" and reasoning is None:
            return None
        opened = reasoning is not None and prompt_opened_thinking(prompt_text)

        def make() -> AnswerShaper:
            tool_parser: StreamParser | None = None
            if plan.mode == "auto":
                assert plan.parser is not None
                tool_parser = make_tool_parser(plan.parser, tools)
            elif plan.mode == "required":
                tool_parser = RequiredCalls()
            elif plan.mode == "named":
                assert plan.name is not None
                tool_parser = NamedCall(plan.name)
            # A grammar-constrained answer (required / named) is JSON from its first token: no thinking.
            thinks = reasoning is not None and plan.grammar is None
            think = ThinkParser(reasoning, opened) if thinks and reasoning is not None else None
            return AnswerShaper(
                reasoning=think,
                tools=tool_parser,
                max_calls=plan.max_calls,
                calls_finish=plan.mode != "named",
                call_id=call_id_maker(self.tool_parser),  # the template replays them, whatever the mode
            )

        return make
