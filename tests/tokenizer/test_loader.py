"""load_tokenizer: eos ids come from generation_config, then config, then tokenizer_config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from himamba.services.tokenizer.loader import load_tokenizer


@pytest.fixture
def ckpt(tmp_path: Path, demo_tokenizer: Tokenizer) -> Path:
    demo_tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def _write(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj))


def test_generation_config_wins(ckpt: Path) -> None:
    _write(ckpt / "generation_config.json", {"eos_token_id": [2, 3]})
    _write(ckpt / "config.json", {"eos_token_id": 1, "vocab_size": 4096})
    loaded = load_tokenizer(ckpt)
    assert loaded.eos_token_ids == [2, 3]
    assert loaded.vocab_size == 4096


def test_config_then_tokenizer_config(ckpt: Path, demo_tokenizer: Tokenizer) -> None:
    _write(ckpt / "config.json", {"eos_token_id": 1})
    assert load_tokenizer(ckpt).eos_token_ids == [1]
    _write(ckpt / "config.json", {})
    _write(ckpt / "tokenizer_config.json", {"eos_token": {"content": "<|user|>"}})
    loaded = load_tokenizer(ckpt)
    assert loaded.eos_token_ids == [demo_tokenizer.token_to_id("<|user|>")]
    assert loaded.vocab_size == demo_tokenizer.get_vocab_size(with_added_tokens=True)


def test_no_eos_anywhere_gives_an_empty_list(ckpt: Path) -> None:
    assert load_tokenizer(ckpt).eos_token_ids == []


def test_missing_tokenizer_json_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_tokenizer_flag_takes_the_tokenizer_from_another_dir(tmp_path: Path, demo_tokenizer: Tokenizer) -> None:
    """--tokenizer DIR: tokenizer.json and tokenizer_config.json from DIR, the model's own eos ids first."""
    model, tok = tmp_path / "model", tmp_path / "tok"
    model.mkdir()
    tok.mkdir()
    demo_tokenizer.save(str(tok / "tokenizer.json"))
    _write(model / "config.json", {"vocab_size": 4096})
    _write(tok / "tokenizer_config.json", {"eos_token": "<|user|>"})
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(model)
    loaded = load_tokenizer(model, tok)
    assert loaded.vocab_size == 4096
    assert loaded.eos_token_ids == [demo_tokenizer.token_to_id("<|user|>")]
    _write(model / "generation_config.json", {"eos_token_id": 5})
    assert load_tokenizer(model, tok).eos_token_ids == [5]
