"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from himamba.services.modelgen.tokenizer_files import CHAT_TEMPLATE as DEMO_TEMPLATE
from himamba.services.tokenizer.http.chat_template import TemplateError, load_chat_template

# Exercises what real templates use: bos_token, loop controls, tojson, raise_exception, namespace.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
  {%- if m['role'] == 'system' -%}{%- set ns.system = m['content'] -%}{%- continue -%}{%- endif -%}
  {%- if m['role'] not in ['user', 'assistant'] -%}{{ raise_exception('unknown role ' + m['role']) }}{%- endif -%}
  [{{ m['role'] | upper }}{% if loop.last %}*{% endif %}] {{ m['content'] | trim }}{{ eos_token }}
{% endfor %}
{%- if ns.system %}<sys>{{ ns.system | tojson }}</sys>{% endif %}
{%- if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}
{%- if add_generation_prompt %}[ASSISTANT] {% endif %}"""

MESSAGES = [
    {"role": "system", "content": 'Ünïcode "quoted" <tag>'},
    {"role": "user", "content": "  hello  "},
    {"role": "assistant", "content": "hi!"},
    {"role": "user", "content": "日本語?"},
]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from himamba.services.modelgen.tokenizer_files import build_demo_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    build_demo_tokenizer().save(str(path))
    return path


def _write_model(tmp_path: Path, template: object, tokenizer_json: Path | None = None) -> Path:
    if tokenizer_json is not None:  # only transformers needs it
        (tmp_path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    cfg = {"eos_token": "<|endoftext|>", "bos_token": "<|system|>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("template", [DEMO_TEMPLATE, RICH_TEMPLATE], ids=["demo", "rich"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(tmp_path: Path, tokenizer_json: Path, template: str, add_generation_prompt: bool):
    from transformers import PreTrainedTokenizerFast

    model_dir = _write_model(tmp_path, template, tokenizer_json)
    hf = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    ours = load_chat_template(model_dir)
    assert ours is not None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for kwargs in ({}, {"tools": tools}):
        expected = hf.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        assert ours.render(MESSAGES, add_generation_prompt=add_generation_prompt, **kwargs) == expected


def test_template_errors_are_value_errors(tmp_path: Path):
    ours = load_chat_template(_write_model(tmp_path, RICH_TEMPLATE))
    assert ours is not None
    with pytest.raises(TemplateError, match="unknown role tool"):
        ours.render([{"role": "tool", "content": "x"}])


def test_missing_named_and_broken_templates(tmp_path: Path):
    (tmp_path / "a").mkdir()
    assert load_chat_template(_write_model(tmp_path / "a", None)) is None
    (tmp_path / "b").mkdir()
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    tpl = load_chat_template(_write_model(tmp_path / "b", named))
    assert tpl is not None and tpl.render([]) == "D<|endoftext|>"
    (tmp_path / "c").mkdir()
    with pytest.raises(ValueError, match="chat_template"):
        load_chat_template(_write_model(tmp_path / "c", "{% for x in %}"))


def test_request_kwargs_override_special_tokens(tmp_path: Path):
    tpl = load_chat_template(_write_model(tmp_path, "{{ bos_token }}|{{ flavour }}"))
    assert tpl is not None
    assert tpl.render([], extra={"flavour": "x"}) == "<|system|>|x"
    assert tpl.render([], extra={"bos_token": "B", "flavour": "y"}) == "B|y"


def test_chat_template_flag_replaces_the_checkpoints(tmp_path: Path):
    """--chat-template: a file, or the template itself, wins over the checkpoint's."""
    model = _write_model(tmp_path, "checkpoint's {{ eos_token }}")
    inline = load_chat_template(model, "inline {{ eos_token }}")
    assert inline is not None and inline.render([]) == "inline <|endoftext|>"
    path = tmp_path / "mine.jinja"
    path.write_text("file {{ bos_token }}")
    from_file = load_chat_template(model, str(path))
    assert from_file is not None and from_file.render([]) == "file <|system|>"
    (tmp_path / "none").mkdir()
    assert load_chat_template(tmp_path / "none", str(path)) is not None  # a checkpoint without one can chat
