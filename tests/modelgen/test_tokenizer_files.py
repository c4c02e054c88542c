"""The demo tokenizer: byte-level round trips, special tokens, determinism, transformers compatibility."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from himamba.services.modelgen.tokenizer_files import build_demo_tokenizer, train_demo_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_demo_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=1024)


@pytest.mark.parametrize(
    "text",
    ["def f(x):\n    return x * 2\n", "héllo wörld — ünïcødé", "emoji 🤖🚀 and CJK 漢字", "\x00\x01\t\r\n  ", ""],
)
def test_any_text_round_trips(tokenizer_dir: Path, text: str) -> None:
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert tok.decode(tok.encode(text).ids) == text


def test_special_tokens_and_size(tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert tok.get_vocab_size() == 1024
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.encode("<|user|>hi<|endoftext|>").ids[0] == tok.token_to_id("<|user|>")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>"
    # Merges were learned from Python source: a common keyword is one token.
    assert len(tok.encode(" return").ids) == 1


def test_training_is_deterministic(tokenizer_dir: Path) -> None:
    again = build_demo_tokenizer(vocab_size=1024)
    assert json.loads(again.to_str()) == json.loads((tokenizer_dir / "tokenizer.json").read_text())


def test_transformers_loads_it_with_the_chat_template(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tok.eos_token_id == 0
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nhi<|endoftext|>\n<|assistant|>\n"


def test_too_small_vocab_is_rejected() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_demo_tokenizer(vocab_size=100)
