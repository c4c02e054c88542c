"""Structured outputs: a `GrammarSpec` as an llguidance grammar, checked once per (kind, spec).

The engine is llguidance (see docs/api/structured-outputs.md for the measured choice against xgrammar): it imports in
tens of milliseconds and pulls in neither torch, transformers nor triton, builds a grammar in
about a millisecond and computes a token mask in tens of microseconds. The front door checks a
spec here before a request is queued; the worker builds its matchers from the same text.

JSON is generated without free whitespace (compact `,` and `:` separators): a model cannot
spend its token budget on spaces, so a bounded schema bounds the output.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from threading import Lock
from typing import Any

import llguidance

from himamba.common.types import GrammarSpec

# Unknown schema keywords are an error, not ignored: a constraint we cannot enforce is refused.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
MAX_SPEC_CHARS = 1 << 20  # a grammar's source text; larger is refused before it is parsed
CHECK_CACHE_SIZE = 256  # specs whose check result the front door remembers
# llguidance compiles a rule (or a `$ref`) the first time another one names it, by recursion: a
# chain of references costs 3-5 KB of stack a link, and 3,000-4,000 links overflowed an 8 MiB
# stack (SIGSEGV, the whole process). Rule definitions plus `$ref`s bound the chain's length.
MAX_GRAMMAR_RULES = 1000
# The stack of every thread that builds grammars (the front door's checks, the worker's builds):
# MAX_GRAMMAR_RULES links need about 5 MiB of it, whatever the platform's default thread stack is.
GRAMMAR_STACK_BYTES = 64 << 20
# Alternatives open at once: llguidance's parser holds 2,000 items a row (`max_items_in_row`), and
# a choice or anyOf of more fails at the first token. A static bound refuses the plain cases.
MAX_ALTERNATIVES = 1000
MAX_ITEMS_IN_ROW = 2000
# Every failure of a matcher after its build (the output ran into a limit, or a grammar with no
# finite text) is reported with this text: the client's request, not the server, is at fault.
GRAMMAR_DEAD_END = "grammar: the output cannot follow the grammar any further"
_RULE_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:::=|:)", re.MULTILINE)  # GBNF or Lark


def parser_limits() -> llguidance.LLParserLimits:
    """Bounds on one grammar's build and per-token work (a hostile grammar fails, it does not
    stall the process); errors keep no grammar text (they reach clients)."""
    return llguidance.LLParserLimits(max_grammar_size=200_000, max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)


def grammar_thread_pool(name: str) -> ThreadPoolExecutor:
    """A one-thread pool whose thread has GRAMMAR_STACK_BYTES of stack, for grammar builds."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    with _STACK_SIZE_LOCK:
        before = threading.stack_size(GRAMMAR_STACK_BYTES)
        try:
            pool.submit(lambda: None).result()  # the pool's thread starts now, with that stack
        finally:
            threading.stack_size(before)
    return pool


_STACK_SIZE_LOCK = Lock()


def _bound_references(text: str, what: str) -> None:
    count = len(_RULE_DEFINITION.findall(text)) + text.count("$ref")
    if count > MAX_GRAMMAR_RULES:
        raise ValueError(
            f"{what} has {count} rules and $refs, more than {MAX_GRAMMAR_RULES} (the most one grammar may hold)"
        )


def _choices(spec: str) -> list[str]:
    try:
        items = json.loads(spec)
    except ValueError as e:
        raise ValueError(f"choice must be a JSON list of strings: {e}") from None
    if not isinstance(items, list) or not items or not all(isinstance(s, str) for s in items):
        raise ValueError("choice must be a non-empty list of strings")
    if not all(items):
        raise ValueError("choice: every choice must be a non-empty string")
    if len(items) > MAX_ALTERNATIVES:
        raise ValueError(f"choice has {len(items)} strings, more than {MAX_ALTERNATIVES}")
    return items


def _bound_alternatives(schema: Any) -> None:
    """The longest anyOf / oneOf list of `schema` is at most MAX_ALTERNATIVES (iterative: the
    schema is as deep as JSON parsing let it be)."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key in ("anyOf", "oneOf"):
                alts = node.get(key)
                if isinstance(alts, list) and len(alts) > MAX_ALTERNATIVES:
                    raise ValueError(f"{key} has {len(alts)} alternatives, more than {MAX_ALTERNATIVES}")
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of `spec`; ValueError when its source does not parse or is over
    the limits (MAX_SPEC_CHARS, MAX_GRAMMAR_RULES)."""
    if len(spec.spec) > MAX_SPEC_CHARS:
        raise ValueError(f"{spec.kind} is {len(spec.spec)} characters, more than {MAX_SPEC_CHARS}")
    if spec.kind in ("json_schema", "ebnf"):  # before any conversion: refused at once
        _bound_references(spec.spec, "the grammar" if spec.kind == "ebnf" else "the JSON schema")
    text = _grammar_text(spec)
    _bound_references(text, "the grammar")  # what the library compiles (a conversion may add rules)
    return text


def _grammar_text(spec: GrammarSpec) -> str:
    match spec.kind:
        case "json_schema" | "json_object":
            source = spec.spec if spec.kind == "json_schema" else '{"type": "object"}'
            try:
                schema = json.loads(source)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            except RecursionError:
                raise ValueError("the JSON schema is nested too deeply") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object (or true/false)")
            _bound_alternatives(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
        case "regex":
            if not spec.spec:
                raise ValueError("regex must be non-empty")
            return llguidance.LLMatcher.grammar_from_regex(spec.spec)
        case "choice":
            lark = "start: " + " | ".join(json.dumps(s) for s in _choices(spec.spec))
            return llguidance.LLMatcher.grammar_from_lark(lark)
        case "ebnf":
            if not spec.spec.strip():
                raise ValueError("grammar must be non-empty")
            try:  # GBNF (`root ::= ...`, llama.cpp / xgrammar) or Lark (`start: ...`)
                return llguidance.grammar_from("ebnf", spec.spec)
            except ValueError as e:
                raise ValueError(str(e).replace("Failed to convert the grammar from GBNF to Lark: ", "")) from None
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


def make_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """The engine's view of a HF `tokenizer.json` (its text). `vocab_size` is the model's (logit
    rows past the tokenizer's own vocabulary are never allowed); a finished grammar allows only
    `eos_token_ids` (the tokenizer's own end token when empty)."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids or None)


def new_matcher(spec: GrammarSpec, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A fresh matcher of `spec` (ValueError naming the problem when the grammar is invalid)."""
    return matcher_from_text(grammar_text(spec), tokenizer)


def matcher_from_text(text: str, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    """A fresh matcher of a grammar already lowered by `grammar_text` (native work only: the
    library releases the GIL while it compiles); ValueError naming the problem when invalid."""
    m = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
    if m.is_error():
        raise ValueError(m.get_error())
    return m


def spec_key(spec: GrammarSpec) -> bytes:
    """A cache key of `spec` whose size does not grow with the spec (specs may be a megabyte)."""
    return hashlib.sha256(f"{spec.kind}\0{spec.spec}".encode("utf-8", "surrogatepass")).digest()


class GrammarChecks:
    """Check specs once: an LRU of (kind, spec) -> error text ("" when valid). Thread-safe."""

    def __init__(
        self, tokenizer: Callable[[], llguidance.LLTokenizer] | None = None, size: int = CHECK_CACHE_SIZE
    ) -> None:
        """`tokenizer` makes the tokenizer to check against (called once, at the first check);
        without one the grammar is checked on its own."""
        self._make_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.size = size
        self._seen: OrderedDict[bytes, str] = OrderedDict()
        self._lock = Lock()

    def check(self, spec: GrammarSpec) -> None:
        """Raise ValueError (the engine's reason) when `spec` cannot be built."""
        key = spec_key(spec)
        with self._lock:
            error = self._seen.get(key)
            if error is not None:
                self._seen.move_to_end(key)
        if error is None:
            error = self._compute(spec)
            if self._make_tokenizer is None or self._tokenizer is not None:  # a verdict on the spec itself
                with self._lock:
                    self._seen[key] = error
                    while len(self._seen) > self.size:
                        self._seen.popitem(last=False)
        if error:
            raise ValueError(error)

    def _compute(self, spec: GrammarSpec) -> str:
        try:
            text = grammar_text(spec)
        except ValueError as e:
            return str(e)
        if self._make_tokenizer is None:
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, None, limits=parser_limits())
            return messages[0] if is_error else ""
        with self._lock:
            if self._tokenizer is None:
                try:
                    self._tokenizer = self._make_tokenizer()
                except (ValueError, RuntimeError, OSError) as e:  # not cached: a fixed file is read again
                    return f"structured outputs are not available with this model's tokenizer ({e})"
            tokenizer = self._tokenizer
        m = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
        return m.get_error() if m.is_error() else _first_step_error(m)


def _first_step_error(m: llguidance.LLMatcher) -> str:
    """Why `m` fails at its first token ("" when it does not). A grammar with no finite text (a
    rule or $ref that only refers to itself) or too many open alternatives builds, and fails only
    as the output starts: its first mask and one allowed token show it here, before a request is
    queued."""
    mask = m.compute_bitmask()
    if not m.is_error():
        first = next((i * 8 + b for i, byte in enumerate(mask) if byte for b in range(8) if byte >> b & 1), None)
        if first is None:
            return "" if m.is_accepting() else "the grammar allows no text"
        m.consume_token(first)
        if not m.is_error():
            m.compute_bitmask()
    if not m.is_error():
        return ""
    return (  # our words: the library's text names its internals
        "the grammar cannot be followed from its first token: it has no finite text (a rule or $ref "
        f"that only refers to itself), or more alternatives open at once than the parser holds ({MAX_ITEMS_IN_ROW})"
    )
