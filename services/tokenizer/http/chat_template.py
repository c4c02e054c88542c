"""A checkpoint's chat template (tokenizer_config.json `chat_template`), rendered as HF renders it.

Same environment as transformers' `apply_chat_template`: a sandboxed jinja2 environment with
trim_blocks and lstrip_blocks, the loopcontrols extension, `raise_exception`, `strftime_now`
and a `tojson` filter that does not HTML-escape. The template sees `messages`,
`add_generation_prompt`, `tools`, `documents` and the special tokens (`bos_token`,
`eos_token`, ...) as strings. The rendered text is tokenized without adding special tokens:
the template writes them itself.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older files store an AddedToken as a dict
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"chat_template: syntax error at line {e.lineno}: {e.message}") from None
        self.special_tokens = dict(special_tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of `messages`; TemplateError when the template refuses them."""
        kwargs = {**self.special_tokens, **(extra or {})}  # request kwargs win, as in HF
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"chat template: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise TemplateError(f"chat template failed on these messages: {e!r}") from None


def load_chat_template(model_dir: str | Path, override: str = "") -> ChatTemplate | None:
    """The template of `model_dir/tokenizer_config.json` (or `chat_template.jinja`), or None if it has
    none; `override` (`--chat-template`: a Jinja file, or the template itself) replaces it."""
    model_dir = Path(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        data = json.loads(config_path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            config = data
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates: HF uses "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    jinja_file = model_dir / "chat_template.jinja"
    if not isinstance(source, str) and jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    if override:
        is_inline = "{{" in override or "{%" in override
        source = override if is_inline else Path(override).read_text(encoding="utf-8")
    if not isinstance(source, str) or not source:
        return None
    special = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    return ChatTemplate(source, special)
