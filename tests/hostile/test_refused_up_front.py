"""Input that used to be accepted and then fail (a 500, or a dead front door) is a 400 before any
work starts, in our words: grammars that overflowed the grammar library's stack (turn 3's N1),
constraints that build but cannot be followed, a top_p that float32 cannot hold, and a body that
does not decompress (N7). The server stays up through all of it."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from himamba.common.grammar import MAX_GRAMMAR_RULES
from tests.hostile.conftest import API_KEY, Door, Hostile
from tests.http_request import http_request


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **fields}


def _refused(hostile: Hostile, body: dict[str, Any], why: str, path: str = "/v1/chat/completions") -> None:
    r = hostile.post(path, body)
    assert r.status == 400, (r.status, r.body[:300])
    message = r.json()["error"]["message"]
    assert why in message, message
    for internal in ("NoExtensionBias", "Parser Error", "parser error", "RuntimeError"):
        assert internal not in message, message


def _still_serves(hostile: Hostile) -> None:
    assert hostile.alive()
    r = hostile.post("/v1/completions", {"prompt": [11, 12], "max_tokens": 2, "ignore_eos": True})
    assert r.status == 200, r.body[:300]


def _rule_chain(n: int) -> str:
    return "root ::= r0\n" + "\n".join(f'r{i} ::= "x{i}" r{i + 1} | "y"' for i in range(n)) + f'\nr{n} ::= "z"'


def test_a_grammar_chaining_5000_rules_is_a_400_naming_the_limit(hostile: Hostile, door: Door) -> None:
    # 143 KB: the turn-3 request that made the front door SIGSEGV inside the grammar library.
    _refused(hostile, _chat(structured_outputs={"grammar": _rule_chain(5000)}), f"more than {MAX_GRAMMAR_RULES}")
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(3000)}
    defs["d3000"] = {"type": "string"}
    schema = {"$defs": defs, "$ref": "#/$defs/d0"}  # a chain of $refs overflowed the stack the same way
    _refused(hostile, _chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}),
             f"more than {MAX_GRAMMAR_RULES}")  # fmt: skip
    # ZeroMQ clients go through the front door's own check (no HTTP parsing before it).
    grammar = {"kind": "ebnf", "spec": _rule_chain(5000)}
    reply = door.refused([msgspec.msgpack.encode(door.request(sampling={"max_tokens": 2, "grammar": grammar}))])
    assert f"more than {MAX_GRAMMAR_RULES}" in reply.message, reply
    _still_serves(hostile)
    door.still_serves()


def _schema(schema: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}


FOLLOWED_NEVER = [
    _schema({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    _schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    _schema({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    {"structured_outputs": {"grammar": 'root ::= "a" root'}},  # an empty language
    {
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    },
]


@pytest.mark.parametrize("fields", FOLLOWED_NEVER, ids=["ref-root", "ref-cycle", "ref-self", "ebnf-no-end", "tool-ref"])
def test_a_constraint_that_builds_but_cannot_be_followed_is_a_400_before_work(hostile: Hostile, fields) -> None:
    _refused(hostile, _chat(**fields), "cannot be followed")
    _still_serves(hostile)


def test_constraints_over_the_parsers_alternatives_are_a_400_naming_the_limit(hostile: Hostile) -> None:
    anyof = [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]} for i in range(3000)]
    _refused(hostile, _chat(**_schema({"anyOf": anyof})), "anyOf has 3000 alternatives, more than 1000")
    choices = [f"c{i}" for i in range(60000)]
    _refused(hostile, _chat(structured_outputs={"choice": choices}), "choice has 60000 strings, more than 1000")
    _still_serves(hostile)


@pytest.mark.parametrize("top_p", [1e-46, 1e-300])
def test_a_top_p_float32_cannot_hold_is_a_400(hostile: Hostile, door: Door, top_p: float) -> None:
    body = {"prompt": [1], "max_tokens": 4, "top_p": top_p, "temperature": 1}
    _refused(hostile, body, "top_p must be in", path="/v1/completions")
    sampling = {"max_tokens": 2, "top_p": top_p, "temperature": 1.0}
    assert "top_p must be in" in door.refused([msgspec.msgpack.encode(door.request(sampling=sampling))]).message
    _still_serves(hostile)


def test_a_gzip_body_that_does_not_decompress_is_a_400(hostile: Hostile) -> None:
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip", "Authorization": f"Bearer {API_KEY}"}
    r = http_request(hostile.port, "POST", "/v1/completions", b"\x1f\x8b\x08\x00junk" * 20, headers)
    assert r.status == 400, (r.status, r.body[:300])
    assert "gzip" in r.json()["error"]["message"], r.body[:300]
    _still_serves(hostile)


def test_replies_over_the_logprob_bound_are_a_400_alone_and_batched(hostile: Hostile) -> None:
    """Turn 3's N5 (prompt_logprobs 20 x n 16 on a long prompt: a 95 MB reply) and turn 4's batch (64
    prompts x 1,000 tokens with echo and logprobs 5, each prompt under the bound: 22.8 MB), at this
    server's context: both refused before they run, naming the product."""
    long_ids = [3 + (i * 7) % 997 for i in range(1000)]
    alone = {"prompt": long_ids, "max_tokens": 1, "prompt_logprobs": 20, "n": 16, "temperature": 1}
    _refused(hostile, alone, "prompt_logprobs: 999 tokens x 21, each times n 16", path="/v1/completions")
    batch = {"prompt": [[4 + i, *long_ids[1:]] for i in range(64)], "max_tokens": 1, "echo": True, "logprobs": 5}
    _refused(hostile, batch, "these 64 prompts would carry 384000 logprob entries in all", path="/v1/completions")
    _still_serves(hostile)
