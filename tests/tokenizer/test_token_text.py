"""Token names in logprobs (http/token_text.py): byte tokens that decode to "\\ufffd" alone are
named by their bytes as OpenAI does, so no two tokens of a byte-level vocabulary share a name;
vLLM's `token_id:<id>` on request."""

from __future__ import annotations

from tokenizers import Tokenizer

from himamba.services.tokenizer.http.token_text import TokenText


def test_every_token_has_its_own_name(demo_tokenizer: Tokenizer):
    names = TokenText(demo_tokenizer)
    size = demo_tokenizer.get_vocab_size(with_added_tokens=True)
    completion = [names.completion_name(t) for t in range(size)]
    chat = [names.chat_name(t) for t in range(size)]
    raw = [names.raw_bytes(t) for t in range(size)]
    decoded = [demo_tokenizer.decode([t], skip_special_tokens=False) for t in range(size)]
    assert decoded.count("\ufffd") > 1  # the collision the names avoid
    assert len(set(completion)) == size and len(set(chat)) == size and len(set(raw)) == size
    partial = [t for t in range(size) if decoded[t] == "\ufffd"]
    assert all(completion[t].startswith("bytes:\\x") for t in partial)
    assert all(chat[t] == completion[t][len("bytes:") :] for t in partial)
    # A character split over tokens: their bytes join into its UTF-8.
    ids = demo_tokenizer.encode("é日").ids
    assert b"".join(names.raw_bytes(t) for t in ids) == "é日".encode()
    assert TokenText(demo_tokenizer, as_ids=True).completion_name(ids[0]) == f"token_id:{ids[0]}"
