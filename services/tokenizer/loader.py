"""Read what the front door needs from a checkpoint directory: the tokenizer, eos ids, vocab size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import Tokenizer


class LoadedTokenizer(NamedTuple):
    """The fast tokenizer of a checkpoint plus the ids the scheduler stops on."""

    tokenizer: Tokenizer
    eos_token_ids: list[int]
    vocab_size: int  # the model's (config.json), which may exceed the tokenizer's own


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _eos_ids(model_dir: Path, tokenizer_dir: Path, tokenizer: Tokenizer) -> list[int]:
    # generation_config.json is what HF generate() honours, so it wins over config.json.
    for name in ("generation_config.json", "config.json"):
        ids = _as_id_list(_read_json(model_dir / name).get("eos_token_id"))
        if ids:
            return ids
    token = _read_json(tokenizer_dir / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):  # older files store an AddedToken as a dict
        token = token.get("content")
    if isinstance(token, str):
        tid = tokenizer.token_to_id(token)
        if tid is not None:
            return [tid]
    return []


def load_tokenizer(model_dir: str | Path, tokenizer_dir: str | Path | None = None) -> LoadedTokenizer:
    """Load `tokenizer.json` (from `tokenizer_dir`, by default the model's) and the eos ids
    (the model's generation_config and config, then the tokenizer's tokenizer_config)."""
    model_dir = Path(model_dir)
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir else model_dir
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"model: {tokenizer_dir} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path))
    vocab = _read_json(model_dir / "config.json").get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    return LoadedTokenizer(tokenizer, _eos_ids(model_dir, tokenizer_dir, tokenizer), vocab)
