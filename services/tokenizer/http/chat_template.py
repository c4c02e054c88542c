"""A checkpoint's chat template, rendered exactly as transformers' `apply_chat_template` renders it.

The server never imports transformers: its template environment is rebuilt here on jinja2 (as of
transformers 5.x, `utils/chat_template_utils.py`): a sandboxed environment with trim_blocks and
lstrip_blocks, the loopcontrols extension, the `{% generation %}` block (transformers'
AssistantTracker: its content is rendered, the marks are not), `raise_exception`,
`strftime_now`, a `tojson` filter that does not HTML-escape, and its `dict` and `namespace`.
The template sees `messages` (keys whose value is null dropped; reasoning copied under
`reasoning_content` and `thinking`), `add_generation_prompt`, `tools`, `documents`, the named
special tokens (`bos_token`, `eos_token`, ...) as strings, and the request's
`chat_template_kwargs` (which win over the special tokens). `continue_final_message` leaves the
last message open as transformers does. Templates are found where transformers finds them:
`chat_template.jinja` (and `additional_chat_templates/*.jinja`) before tokenizer_config.json's
`chat_template`; with several, "tool_use" when tools are given, else "default". The rendered
text is tokenized without adding special tokens: the template writes them itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# transformers' SPECIAL_TOKENS_ATTRIBUTES: what `special_tokens_map` holds when set.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning arrives under; the first is the one templates read (transformers' order).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the message continue_final_message leaves open, found again after rendering.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it
    (return_assistant_tokens_mask); a prompt is its content, unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(lineno)

    def _content(self, caller: jinja2.runtime.Macro) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes HTML characters; transformers' does not, and exposes these options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """`dict(...)` in a template: builds plain dicts, and exposes nothing else (as transformers')."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace refusing underscore names (CPython internals), as transformers' does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older files store an AddedToken as a dict
        value = value.get("content")
    return value if isinstance(value, str) else None


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """transformers' `_alias_reasoning_fields`: reasoning under any name is also `reasoning_content`
    (what templates read) and `thinking` (gpt-oss templates)."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """A checkpoint's compiled template(s) plus the special-token strings they may refer to."""

    def __init__(
        self,
        source: str | Mapping[str, str],
        special_tokens: Mapping[str, str],
        now: Callable[[], datetime] = datetime.now,
    ):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
        env.globals["dict"] = _TemplateDict()
        env.globals["namespace"] = _TemplateNamespace
        sources = {"default": source} if isinstance(source, str) else dict(source)
        self._sources = sources
        self._templates: dict[str, jinja2.Template] = {}
        for name, text in sources.items():
            try:
                self._templates[name] = env.from_string(text)
            except jinja2.exceptions.TemplateSyntaxError as e:
                where = "" if name == "default" else f" ({name})"
                raise ValueError(f"chat_template{where}: syntax error at line {e.lineno}: {e.message}") from None
        self.special_tokens = dict(special_tokens)
        self.source = "\n".join(sources.values())  # all of it: read for the formats it teaches (tool calls, <think>)

    def _pick(self, tools: list[dict[str, Any]] | None) -> str:
        if len(self._templates) == 1:
            return next(iter(self._templates))
        if tools is not None and "tool_use" in self._templates:
            return "tool_use"
        if "default" in self._templates:
            return "default"
        raise TemplateError(
            f"the model has several chat templates and none is named default: {sorted(self._templates)}"
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of `messages`; TemplateError when the template refuses them."""
        if continue_final_message and add_generation_prompt:
            raise TemplateError(
                "continue_final_message and add_generation_prompt are not compatible: set add_generation_prompt "
                "false to continue the final message"
            )
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise TemplateError("documents must be a list of objects (with 'title' and 'text' keys)")
        name = self._pick(tools)
        chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        final = ""
        if continue_final_message:
            final = self._open_final(chat, self._sources[name])
        kwargs = {**self.special_tokens, **(extra or {})}  # request kwargs win, as in HF
        try:
            text = self._templates[name].render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"chat template: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise TemplateError(f"chat template failed on these messages: {e!r}") from None
        return _cut_at_continue_tag(text, final) if continue_final_message else text

    @staticmethod
    def _open_final(chat: list[dict[str, Any]], source: str) -> str:
        """Tag the final message's content (transformers' continue_final_message); its text."""
        if not chat:
            raise TemplateError("continue_final_message is set but the conversation is empty")
        final = chat[-1].get("content")
        if not isinstance(final, str):
            raise TemplateError('continue_final_message is set but the final message has no "content" to continue')
        if "content" not in source:
            raise TemplateError('continue_final_message: this chat template does not read "content"')
        chat[-1]["content"] = final + _CONTINUE_TAG
        return final


def _cut_at_continue_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise TemplateError(
            "continue_final_message: the final message does not appear in the rendered chat "
            "(the template drops part of it)"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


def _checkpoint_templates(model_dir: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """transformers' lookup: the .jinja files, else tokenizer_config.json's `chat_template`."""
    files: dict[str, str] = {}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        files["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            files[path.stem] = path.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates
        return {t["name"]: t["template"] for t in source if isinstance(t, dict) and isinstance(t.get("template"), str)}
    return source if isinstance(source, str) and source else None


def read_override(override: str) -> str:
    """`--chat-template`: a Jinja file, or the template itself."""
    path = Path(override).expanduser()
    if "{{" not in override and "{%" not in override:
        try:
            return path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--chat-template: {override} is neither a readable file nor a Jinja template: {e}")
    return override


def special_tokens_of(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens transformers passes to templates (its `special_tokens_map`):
    bos/eos/unk/sep/pad/cls/mask when set, and `extra_special_tokens` given by name."""
    special = {k: t for k in _SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        special.update({k: t for k, v in extra.items() if (t := _token_text(v)) is not None})
    return special


def load_chat_template(
    model_dir: str | Path, override: str = "", now: Callable[[], datetime] = datetime.now
) -> ChatTemplate | None:
    """The template of the checkpoint `model_dir`, or None if it has none; `override`
    (`--chat-template`: a Jinja file, or the template itself) replaces it."""
    model_dir = Path(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        data = json.loads(config_path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            config = data
    source: str | dict[str, str] | None
    source = read_override(override) if override else _checkpoint_templates(model_dir, config)
    if not source:
        return None
    return ChatTemplate(source, special_tokens_of(config), now)
