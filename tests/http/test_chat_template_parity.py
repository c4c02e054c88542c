"""Template parity: the checkpoints' chat templates, and templates using each of transformers'
extensions, render the same token ids as transformers' `apply_chat_template` (no model runs).

Every family's demo checkpoint (`make_checkpoint`, any arch) writes its tokenizer files with
`train_demo_tokenizer` at the preset's vocabulary (2048 for every tiny checkpoint, 8192 for
nemotron_h medium): those two tokenizers and their template are checked here. `strftime_now`
reads a frozen clock on both sides."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from himamba.services.modelgen.tokenizer_files import CHAT_TEMPLATE as DEMO_TEMPLATE
from himamba.services.modelgen.tokenizer_files import train_demo_tokenizer
from himamba.services.tokenizer.http.chat_template import TemplateError, load_chat_template

FROZEN = datetime.datetime(2026, 3, 14, 15, 9, 26)

CONVERSATION = [
    {"role": "system", "content": 'Be <nice> & "exact" 日本語'},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "add them"},
    {"role": "user", "content": "  and 3+3?  "},
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": None,  # transformers drops null keys before rendering
        "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}],
    },
    {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "c1"},
    {"role": "assistant", "content": "21 degrees", "reasoning": "the tool said so"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Météo <now>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
DOCUMENTS = [{"title": "Paris", "text": "Capital of France."}, {"title": "Lyon", "text": "Gastronomy & silk."}]

# One template per transformers extension (plus the ones real templates lean on).
EXTENSION_TEMPLATES = {
    # AssistantTracker: the block renders its content; the marks are for assistant masks only.
    "generation": (
        "{% for m in messages %}<|{{ m.role }}|>\n"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}"
        "{% else %}{{ m.content }}{{ eos_token }}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    "strftime_now": (
        "<|system|>\nToday is {{ strftime_now('%d %B %Y') }}, {{ strftime_now('%H:%M:%S') }}.{{ eos_token }}\n"
        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    "tojson": (
        "{% for m in messages %}{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=True) }}|"
        "{{ m.content | default('') | tojson(ensure_ascii=True) }}|{{ m | tojson(separators=(',', ':')) }}\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    "tools_and_documents": (
        "{% if tools %}<|system|>\nTools: {% for t in tools %}{{ t.function.name }} {{ t | tojson }}"
        "{% endfor %}{{ eos_token }}\n{% endif %}"
        "{% if documents %}<|system|>\n{% for d in documents %}[{{ loop.index }}] {{ d.title }}: {{ d.text }}\n"
        "{% endfor %}{{ eos_token }}\n{% endif %}"
        "{% for m in messages %}<|{{ m.role }}|>\n{% if m.content is defined %}{{ m.content }}{% endif %}"
        "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
        "{{ c.function.arguments }}</call>{% endfor %}{% endif %}"
        "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}|{{ m.thinking }}</think>{% endif %}"
        "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    # namespace (refusing underscore names), dict(), loop controls, kwargs (chat_template_kwargs).
    "namespace_dict_kwargs": (
        "{% set ns = namespace(last_user=-1, seen=dict()) %}"
        "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "<|{{ m.role }}|>{{ loop.index0 == ns.last_user }}\n{{ m.content | trim }}{{ eos_token }}\n"
        "{% if loop.index > 8 %}{% break %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}{% endif %}{{ bos_token }}"
    ),
}


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' strftime_now reads `datetime.now()` of its module: freeze that."""
    import transformers.utils.chat_template_utils as hf_templates

    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz: Any = None) -> datetime.datetime:
            return FROZEN

    monkeypatch.setattr(hf_templates, "datetime", Frozen)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Demo tokenizer dirs by vocabulary size, each trained once (training takes a second)."""
    return {}


def _trained(trained: dict[int, Path], vocab: int, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if vocab not in trained:
        trained[vocab] = train_demo_tokenizer(tmp_path_factory.mktemp(f"tok{vocab}"), vocab_size=vocab)
    return trained[vocab]


@pytest.fixture(params=[2048, 8192], ids=["tiny-vocab", "medium-vocab"])
def demo_tokenizer_dir(
    request: pytest.FixtureRequest, trained: dict[int, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tokenizer files `make_checkpoint` writes into every demo checkpoint."""
    return _trained(trained, request.param, tmp_path_factory)


@pytest.fixture
def tokenizer_dir(trained: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoints' tokenizer files, for the templates that are not a checkpoint's."""
    return _trained(trained, 2048, tmp_path_factory)


def _with_template(src: Path, dst: Path, template: Any, **config: Any) -> Path:
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    tok_cfg.update(config)
    tok_cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return dst


def _ids_both(model_dir: Path, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[list[int], list[int]]:
    """(transformers' ids, ours) for the same apply_chat_template arguments."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    expected = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    ours = load_chat_template(model_dir, now=lambda: FROZEN)
    assert ours is not None
    known = ("add_generation_prompt", "continue_final_message", "tools", "documents")
    extra = {k: v for k, v in kwargs.items() if k not in known}
    text = ours.render(
        messages,
        add_generation_prompt=kwargs.get("add_generation_prompt", False),
        continue_final_message=kwargs.get("continue_final_message", False),
        tools=kwargs.get("tools"),
        documents=kwargs.get("documents"),
        extra=extra,
    )
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return list(expected), tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_demo_checkpoint_template(demo_tokenizer_dir: Path, add_generation_prompt: bool):
    config = json.loads((demo_tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == DEMO_TEMPLATE
    for messages in (CONVERSATION, CONVERSATION[1:2]):
        expected, ours = _ids_both(demo_tokenizer_dir, messages, add_generation_prompt=add_generation_prompt)
        assert ours == expected and len(ours) > 5


def test_demo_checkpoint_continue_final_message(demo_tokenizer_dir: Path):
    prefill = [*CONVERSATION[:2], {"role": "assistant", "content": "Let me think: "}]
    expected, ours = _ids_both(demo_tokenizer_dir, prefill, continue_final_message=True)
    assert ours == expected
    tokenizer = Tokenizer.from_file(str(demo_tokenizer_dir / "tokenizer.json"))
    assert tokenizer.decode(ours, skip_special_tokens=False).endswith("<|assistant|>\nLet me think: ")


@pytest.mark.parametrize("name", sorted(EXTENSION_TEMPLATES))
@pytest.mark.parametrize(
    "case",
    ["plain", "generation_prompt", "tools_documents", "continue_final", "kwargs"],
)
def test_extension_templates(tokenizer_dir: Path, tmp_path: Path, name: str, case: str):
    model_dir = _with_template(tokenizer_dir, tmp_path, EXTENSION_TEMPLATES[name], bos_token="<|system|>")
    kwargs: dict[str, Any] = {
        "plain": {},
        "generation_prompt": {"add_generation_prompt": True},
        "tools_documents": {"add_generation_prompt": True, "tools": TOOLS, "documents": DOCUMENTS},
        "continue_final": {"continue_final_message": True},
        # request kwargs reach the template and win over the special tokens, as in transformers
        "kwargs": {"add_generation_prompt": True, "enable_thinking": False, "bos_token": "<|user|>"},
    }[case]
    messages = TOOL_CONVERSATION if case == "tools_documents" else CONVERSATION
    if case == "continue_final":
        messages = [*CONVERSATION[:2], {"role": "assistant", "content": "Partial answer"}]
    expected, ours = _ids_both(model_dir, messages, **kwargs)
    assert ours == expected and len(ours) > 3


def test_strftime_now_reads_the_clock(tokenizer_dir: Path, tmp_path: Path):
    """The frozen clock is what both sides printed (the parity above is not two empty dates)."""
    model_dir = _with_template(tokenizer_dir, tmp_path, EXTENSION_TEMPLATES["strftime_now"])
    ours = load_chat_template(model_dir, now=lambda: FROZEN)
    assert ours is not None
    assert "Today is 14 March 2026, 15:09:26." in ours.render(CONVERSATION)


def test_raise_exception_refuses_like_transformers(tokenizer_dir: Path, tmp_path: Path):
    template = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported, got ' + m.role) }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    model_dir = _with_template(tokenizer_dir, tmp_path, template)
    from jinja2.exceptions import TemplateError as JinjaTemplateError
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    message = "Only user and assistant roles are supported, got system"
    with pytest.raises(JinjaTemplateError, match=message):
        hf.apply_chat_template(CONVERSATION, tokenize=False)
    ours = load_chat_template(model_dir)
    assert ours is not None
    with pytest.raises(TemplateError, match=message):
        ours.render(CONVERSATION)
    assert ours.render(CONVERSATION[1:3]) == "What is 2+2?4"


def test_namespace_refuses_underscore_names(tokenizer_dir: Path, tmp_path: Path):
    model_dir = _with_template(tokenizer_dir, tmp_path, "{% set ns = namespace(_x=1) %}{{ ns._x }}")
    ours = load_chat_template(model_dir)
    assert ours is not None
    with pytest.raises(TemplateError, match="underscore"):
        ours.render(CONVERSATION)


def test_named_templates_pick_tool_use_as_transformers(tokenizer_dir: Path, tmp_path: Path):
    named = [
        {"name": "default", "template": "D{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "T{{ tools | length }}{% for m in messages %}{{ m.content }}{% endfor %}"},
    ]
    model_dir = _with_template(tokenizer_dir, tmp_path, named)
    for kwargs in ({}, {"tools": TOOLS}, {"tools": []}):
        expected, ours = _ids_both(model_dir, CONVERSATION[1:2], **kwargs)
        assert ours == expected


def test_chat_template_jinja_wins_over_tokenizer_config(tokenizer_dir: Path, tmp_path: Path):
    model_dir = _with_template(tokenizer_dir, tmp_path, "CONFIG{{ messages[0].content }}")
    (model_dir / "chat_template.jinja").write_text("JINJA{{ messages[0].content }}{{ eos_token }}")
    expected, ours = _ids_both(model_dir, CONVERSATION[1:2])
    assert ours == expected
    template = load_chat_template(model_dir)
    assert template is not None and template.render(CONVERSATION[1:2]).startswith("JINJA")


def test_override_file_or_inline(tokenizer_dir: Path, tmp_path: Path):
    """`--chat-template` (a file, or the template itself) replaces the checkpoint's."""
    path = tmp_path / "t.jinja"
    path.write_text("FILE{{ messages[0].content }}")
    by_file = load_chat_template(tokenizer_dir, str(path))
    inline = load_chat_template(tokenizer_dir, "INLINE{{ messages[0].content }}")
    assert by_file is not None and by_file.render([{"role": "user", "content": "x"}]) == "FILEx"
    assert inline is not None and inline.render([{"role": "user", "content": "x"}]) == "INLINEx"
    with pytest.raises(ValueError, match="neither a readable file"):
        load_chat_template(tokenizer_dir, str(tmp_path / "missing.jinja"))


def test_continue_final_message_refusals(tokenizer_dir: Path):
    ours = load_chat_template(tokenizer_dir)
    assert ours is not None
    with pytest.raises(TemplateError, match="not compatible"):
        ours.render(CONVERSATION, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(TemplateError, match="no \"content\""):
        ours.render([{"role": "assistant"}], add_generation_prompt=False, continue_final_message=True)
