"""common/grammar.py: a GrammarSpec as an llguidance grammar, and the front door's cached checks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from himamba.common.grammar import (
    MAX_GRAMMAR_RULES,
    GrammarChecks,
    grammar_text,
    grammar_thread_pool,
    make_tokenizer,
    new_matcher,
)
from himamba.common.types import GrammarSpec
from tests.worker.test_grammar_masks import EOS, _tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return _tiny_tokenizer()


@pytest.fixture(scope="module")
def vocab(tok):
    return tok.get_vocab_size()


@pytest.mark.parametrize(
    "spec,why",
    [
        (GrammarSpec(kind="json_schema", spec="{nope"), "not valid JSON"),
        (GrammarSpec(kind="json_schema", spec="[1]"), "must be an object"),
        (GrammarSpec(kind="json_schema", spec='{"type": "objekt"}'), "objekt"),
        (GrammarSpec(kind="regex", spec=""), "non-empty"),
        (GrammarSpec(kind="choice", spec="[]"), "non-empty list of strings"),
        (GrammarSpec(kind="choice", spec='["a", 1]'), "list of strings"),
        (GrammarSpec(kind="choice", spec='["a", ""]'), "non-empty string"),
        (GrammarSpec(kind="ebnf", spec="  "), "non-empty"),
        (GrammarSpec(kind="ebnf", spec="root ::= undefined_rule"), "undefined_rule"),
        (GrammarSpec(kind="regex", spec="x" * (1 << 20 + 1)), "characters"),
    ],
)
def test_each_kind_refuses_what_cannot_be_built_with_the_reason(spec, why):
    with pytest.raises(ValueError, match=why):
        GrammarChecks().check(spec)


def test_json_has_no_free_whitespace_and_choice_is_exact(tok, vocab):
    t = make_tokenizer(tok.to_str(), vocab, [EOS])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    m = new_matcher(GrammarSpec(kind="json_schema", spec=json.dumps(schema)), t)
    assert m.validate_tokens(tok.encode('{"a": 1}').ids) < len(tok.encode('{"a": 1}').ids)  # the space is refused
    assert m.validate_tokens(tok.encode('{"a":1}').ids) == len(tok.encode('{"a":1}').ids)
    c = new_matcher(GrammarSpec(kind="choice", spec='["yes", "no ☺"]'), t)
    assert c.consume_tokens(tok.encode("no ☺").ids) and c.is_accepting()
    assert "start:" in grammar_text(GrammarSpec(kind="choice", spec='["a"]'))


def test_front_door_checks_are_cached_and_a_missing_tokenizer_is_an_error_not_a_crash(tok, vocab):
    made = []

    def tokenizer():
        made.append(1)
        return make_tokenizer(tok.to_str(), vocab, [EOS])

    checks = GrammarChecks(tokenizer, size=4)
    checks.check(GrammarSpec(kind="regex", spec="[0-9]+"))
    checks.check(GrammarSpec(kind="regex", spec="[0-9]+"))
    with pytest.raises(ValueError, match="unclosed group"):
        checks.check(GrammarSpec(kind="regex", spec="a(b"))
    assert made == [1]  # one tokenizer for every check

    def missing():
        raise OSError("no tokenizer.json")

    broken = GrammarChecks(missing)
    for _ in range(2):  # not cached: the file may be fixed
        with pytest.raises(ValueError, match="not available with this model's tokenizer"):
            broken.check(GrammarSpec(kind="regex", spec="[0-9]+"))


def test_a_lone_surrogate_anywhere_is_a_value_error_not_a_crash():
    # JSON escapes can carry lone surrogates into a str; they must end as a 400, like any bad spec.
    for kind, spec in [
        ("regex", "\ud800"),
        ("json_schema", '{"enum": ["\ud800"]}'),
        ("choice", '["\ud800"]'),
        ("ebnf", 'root ::= "\ud800"'),
    ]:
        with pytest.raises(ValueError):
            GrammarChecks().check(GrammarSpec(kind=kind, spec=spec))  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["json_schema", "json_object", "regex", "choice", "ebnf"]),
    spec=st.one_of(
        st.text(max_size=40),
        st.text(alphabet='{}[]":,0123456789abtypeobjectstringenum\\ ', max_size=60),
        st.text(alphabet='()[]{}|*+?^$.\\-az09:=" ;', max_size=40),
    ),
)
def test_any_spec_is_accepted_or_a_value_error(kind, spec):
    # Whatever a client sends, the check answers with a verdict: never another exception.
    try:
        GrammarChecks().check(GrammarSpec(kind=kind, spec=spec))
    except ValueError as e:
        assert str(e)


def _rule_chain(n: int) -> str:
    return "root ::= r0\n" + "\n".join(f'r{i} ::= "x{i}" r{i + 1} | "y"' for i in range(n)) + f'\nr{n} ::= "z"'


def _ref_chain(n: int) -> str:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec(kind="ebnf", spec=_rule_chain(5000)),  # GBNF: overflowed the stack (SIGSEGV)
        GrammarSpec(kind="ebnf", spec=_rule_chain(5000).replace(" ::=", ":").replace("root", "start")),  # Lark
        GrammarSpec(kind="ebnf", spec="start: A0\n" + "\n".join(f'A{i}: "x" A{i + 1}' for i in range(5000))),
        GrammarSpec(kind="json_schema", spec=_ref_chain(2000)),  # a $ref chain overflowed it too
    ],
    ids=["gbnf-rules", "lark-rules", "lark-terminals", "json-refs"],
)
def test_a_chain_of_references_over_the_limit_is_refused_naming_it_before_the_library_sees_it(spec):
    with pytest.raises(ValueError, match=f"more than {MAX_GRAMMAR_RULES}"):
        grammar_text(spec)


def test_a_chain_at_the_limit_builds_on_a_grammar_thread():
    # The longest chain the limits let through builds on a grammar thread's stack.
    pool = grammar_thread_pool("test-grammar")
    try:
        for spec in (
            GrammarSpec(kind="ebnf", spec=_rule_chain(MAX_GRAMMAR_RULES - 2)),
            GrammarSpec(kind="json_schema", spec=_ref_chain(MAX_GRAMMAR_RULES - 1)),
        ):
            pool.submit(GrammarChecks().check, spec).result()
    finally:
        pool.shutdown()


def test_a_schema_nested_past_the_json_parser_is_a_value_error():
    deep = '{"type":"object","properties":{"a":' * 3000 + "{}" + "}}" * 3000
    with pytest.raises(ValueError, match="nested too deeply"):
        grammar_text(GrammarSpec(kind="json_schema", spec=deep))


def _json(schema: object) -> GrammarSpec:
    return GrammarSpec(kind="json_schema", spec=json.dumps(schema))


@pytest.mark.parametrize(
    "spec,why",
    [
        # Each built, then failed once the output started (a 500 quoting the library, turn 3).
        (_json({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}), "no finite text"),
        (_json({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "no finite"),
        (_json({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}), "no finite text"),
        (GrammarSpec(kind="ebnf", spec='root ::= "a" root'), "no finite text"),
        (
            _json(
                {
                    "anyOf": [
                        {"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
                        for i in range(3000)
                    ]
                }
            ),
            "anyOf has 3000 alternatives, more than 1000",
        ),
        (GrammarSpec(kind="choice", spec=json.dumps([f"c{i}" for i in range(60000)])), "more than 1000"),
    ],
    ids=["ref-root", "ref-cycle", "ref-self", "ebnf-no-end", "anyOf-3000", "choice-60k"],
)
def test_a_grammar_that_fails_at_its_first_token_is_refused_by_the_check_in_our_words(tok, vocab, spec, why):
    checks = GrammarChecks(lambda: make_tokenizer(tok.to_str(), vocab, [EOS]))
    with pytest.raises(ValueError, match=why) as e:
        checks.check(spec)
    assert "NoExtensionBias" not in str(e.value) and "Parser Error" not in str(e.value)


def test_recursive_grammars_with_an_end_pass_the_check(tok, vocab):
    checks = GrammarChecks(lambda: make_tokenizer(tok.to_str(), vocab, [EOS]))
    tree = {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}
    checks.check(_json({"$defs": {"n": tree}, "$ref": "#/$defs/n"}))
    checks.check(GrammarSpec(kind="ebnf", spec='root ::= "a" root | "b"'))
    checks.check(GrammarSpec(kind="choice", spec=json.dumps([f"c{i}" for i in range(1000)])))
