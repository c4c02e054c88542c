"""`himamba serve` before any service starts: the model settings made concrete and checked."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from himamba.common.config import Config, ConfigError, HttpConfig, ModelConfig
from himamba.services.cli import main, resolve_model


def _ckpt(path: Path, dtype: str = "bfloat16", tokenizer: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"dtype": dtype}))
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


def _cfg(**model) -> Config:
    return Config(model=ModelConfig(**model))


def test_dtype_auto_is_resolved_and_said(tmp_path):
    model = _ckpt(tmp_path / "m")
    cfg, notes = resolve_model(_cfg(model=str(model)))
    assert cfg.model.dtype == "float32" and cfg.model.model == str(model.resolve())
    assert any("dtype float32" in n and "auto" in n and "bfloat16" in n for n in notes)
    cfg, notes = resolve_model(_cfg(model=str(model), device="cuda"))  # resolving needs no GPU
    assert cfg.model.dtype == "bfloat16"


def test_tokenizer_and_chat_template_are_checked_and_made_absolute(tmp_path, monkeypatch):
    model = _ckpt(tmp_path / "m", tokenizer=False)
    tok = _ckpt(tmp_path / "t")
    with pytest.raises(ConfigError, match=r"--model \(model.model\): .* has no tokenizer.json"):
        resolve_model(_cfg(model=str(model)))
    with pytest.raises(ConfigError, match=r"--tokenizer .* has no tokenizer.json"):
        resolve_model(_cfg(model=str(model), tokenizer=str(model)))
    (tmp_path / "chat.jinja").write_text("{{ messages }}")
    monkeypatch.chdir(tmp_path)
    cfg, _ = resolve_model(_cfg(model=str(model), tokenizer="t", chat_template="chat.jinja"))
    assert cfg.model.tokenizer == str(tok.resolve())
    assert cfg.model.chat_template == str((tmp_path / "chat.jinja").resolve())
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert resolve_model(_cfg(model=str(tok), chat_template=inline)).cfg.model.chat_template == inline
    with pytest.raises(ConfigError, match="--chat-template .* neither a file nor a Jinja template"):
        resolve_model(_cfg(model=str(tok), chat_template="missing.jinja"))


def test_generation_config_and_allowed_origins_are_checked(tmp_path, monkeypatch):
    model = _ckpt(tmp_path / "m")
    assert resolve_model(_cfg(model=str(model))).cfg.model.generation_config == "auto"
    assert resolve_model(_cfg(model=str(model), generation_config="vllm")).cfg.model.generation_config == "vllm"
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "generation_config.json").write_text('{"temperature": 0.7}')
    monkeypatch.chdir(tmp_path)
    cfg, _ = resolve_model(_cfg(model=str(model), generation_config="g"))
    assert cfg.model.generation_config == str((tmp_path / "g").resolve())
    with pytest.raises(ConfigError, match=r"--generation-config .* has no generation_config.json"):
        resolve_model(_cfg(model=str(model), generation_config="nowhere"))
    (model / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ConfigError, match=r"--generation-config .* temperature must be"):
        resolve_model(_cfg(model=str(model)))
    (model / "generation_config.json").unlink()
    bad_origins = msgspec.structs.replace(_cfg(model=str(model)), http=HttpConfig(allowed_origins="[oops"))
    with pytest.raises(ConfigError, match=r"--allowed-origins .* not a JSON list"):
        resolve_model(bad_origins)


def test_a_hub_id_gets_a_hint(tmp_path, capsys):
    assert main(["serve", "nvidia/NVIDIA-Nemotron-Nano-9B-v2"]) == 2
    err = capsys.readouterr().err
    assert "not a checkpoint directory" in err and "hf download" in err
