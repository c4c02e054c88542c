"""A demo byte-level BPE tokenizer trained on the Python standard library sources.

Byte-level, so every string round-trips through encode/decode. Training is deterministic
(sorted files, fixed byte cap) and takes about a second on two cores.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
# Order fixes the ids: the end-of-text token is id 0.
SPECIAL_TOKENS = (EOS_TOKEN, "<|user|>", "<|assistant|>", "<|system|>")
# Enough text for a few-thousand-token vocabulary while keeping training near one second.
CORPUS_CAP_BYTES = 4_000_000
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|endoftext|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _stdlib_texts(cap_bytes: int) -> Iterator[str]:
    """Yield stdlib `.py` sources in path order until `cap_bytes` of UTF-8 have been yielded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib files are deliberately not UTF-8
        yield text
        total += len(text.encode("utf-8"))
        if total >= cap_bytes:
            return


def build_demo_tokenizer(vocab_size: int = 2048) -> Tokenizer:
    """Train the byte-level BPE in memory (see `train_demo_tokenizer`)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (the byte alphabet), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_stdlib_texts(CORPUS_CAP_BYTES), trainer)
    return tok


def train_demo_tokenizer(out_dir: Path, vocab_size: int = 2048) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir`; returns `out_dir`.

    Special tokens: `<|endoftext|>` (id 0, eos and pad), `<|user|>`, `<|assistant|>`,
    `<|system|>`. The tokenizer config carries a minimal jinja chat template.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_demo_tokenizer(vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
