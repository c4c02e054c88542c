"""The worker's structured-output masks against a tiny byte-level vocabulary: which tokens a
grammar allows, EOS only once the grammar is complete, unconstrained rows untouched, and a
matcher rebuilt from a sequence's tokens (retraction, restart) equal to one fed step by step."""

from __future__ import annotations

import json
import re

import msgspec
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from himamba.common.grammar import GRAMMAR_DEAD_END
from himamba.common.types import GrammarSpec, SamplingParams
from himamba.services.worker.grammar_masks import GrammarCompiler, GrammarState, unpack_bitmask
from himamba.services.worker.sampler import sample

EOS = 0
MERGES = [('"', "a"), ("{", '"'), ("y", "e"), ("ye", "s")]  # a few multi-byte tokens


def _tiny_tokenizer() -> Tokenizer:
    vocab = {"<|endoftext|>": EOS}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return tok


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return _tiny_tokenizer()


@pytest.fixture(scope="module")
def vocab(tok: Tokenizer) -> int:
    return tok.get_vocab_size() + 5  # the model's vocabulary may be larger than the tokenizer's


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer, vocab: int, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(tok.to_str())
    c = GrammarCompiler(path, vocab, [EOS])
    yield c
    c.close()


def _allowed(compiler: GrammarCompiler, state: GrammarState, vocab: int) -> set[int]:
    masks = compiler.masks([state], vocab)
    assert masks is not None and not masks.errors
    return set(torch.nonzero(unpack_bitmask(masks.bitmask, vocab)[0]).view(-1).tolist())


def test_unpack_bitmask_sets_token_t_from_bit_t_mod_32_of_word_t_div_32():
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    got = unpack_bitmask(words, 100)
    assert got.shape == (3, 100)
    for r in range(3):
        for t in range(100):
            assert bool(got[r, t]) == bool((int(words[r, t // 32]) >> (t % 32)) & 1)


def test_choice_allows_only_the_first_bytes_of_its_choices_and_eos_only_at_the_end(compiler, tok, vocab):
    g = compiler.state(GrammarSpec(kind="choice", spec='["yes", "no"]'), num_prompt=2)
    g.feed(0, torch.tensor([5, 6]))  # the prompt: consumed by nothing
    first = _allowed(compiler, g, vocab)
    assert {tok.decode([t]) for t in first} == {"y", "ye", "yes", "n"}
    assert EOS not in first and all(t < tok.get_vocab_size() for t in first)
    g.feed(2, torch.tensor([tok.token_to_id("ye")]))  # the sampled token comes back as input
    assert {tok.decode([t]) for t in _allowed(compiler, g, vocab)} == {"s"}
    g.feed(3, torch.tensor([tok.token_to_id("s")]))
    assert _allowed(compiler, g, vocab) == {EOS}  # complete: only the end of the sequence


def _generate(compiler, spec: GrammarSpec, vocab: int, seed: int, temperature: float, max_steps: int = 400):
    """Sample with random logits under the grammar, feeding each token back as the next input, as
    the worker sees a sequence. Returns (output ids, the states' matcher after each step)."""
    prompt = [7, 8, 9]
    g = compiler.state(spec, num_prompt=len(prompt))
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    feed_start, feed = 0, prompt
    p = SamplingParams(temperature=temperature, seed=seed)
    for step in range(max_steps):
        g.feed(feed_start, torch.tensor(feed))
        logits = torch.randn(1, vocab, generator=gen) * 3
        masks = compiler.masks([g], vocab)
        got = sample(logits, [p], [step], None, masks)
        assert not got.errors, got.errors
        t = got.tokens[0]
        if t == EOS:
            return out
        out.append(t)
        feed_start, feed = len(prompt) + len(out) - 1, [t]
    raise AssertionError("the grammar never finished")


SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["a", "b", "cc"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["ok", "name", "kind", "n", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_under_a_json_schema_give_valid_compact_json(compiler, tok, vocab, seed):
    jsonschema = pytest.importorskip("jsonschema")
    spec = GrammarSpec(kind="json_schema", spec=json.dumps(SCHEMA))
    out = _generate(compiler, spec, vocab, seed, temperature=1.0)
    text = tok.decode(out)
    jsonschema.validate(json.loads(text), SCHEMA)
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert not re.search(r"\s", outside_strings), text  # whitespace is not free


@pytest.mark.parametrize("seed", range(3))
def test_random_logits_under_a_regex_match_it(compiler, tok, vocab, seed):
    pattern = r"[a-c]{2,5}-[0-9]{3}"
    out = _generate(compiler, GrammarSpec(kind="regex", spec=pattern), vocab, seed, temperature=1.0)
    assert re.fullmatch(pattern, tok.decode(out))


def test_unconstrained_rows_pay_nothing_and_keep_their_logits(compiler, vocab):
    assert compiler.masks([None, None], vocab) is None
    g = compiler.state(GrammarSpec(kind="regex", spec="[0-9]+"), num_prompt=1)
    g.feed(0, torch.tensor([3]))
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    masks = compiler.masks([None, g, None], vocab)
    assert masks is not None and masks.rows == [1]
    masked = masks.apply(logits.clone())
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert int(torch.isfinite(masked[1]).sum()) == 10  # the ten digits


def test_a_matcher_rebuilt_from_history_equals_one_fed_step_by_step(compiler, tok, vocab):
    # Retraction or a restart resets the sequence's table: the worker gets the context before
    # its first new token and rebuilds the matcher from the outputs in it.
    spec = GrammarSpec(kind="json_schema", spec=json.dumps(SCHEMA))
    out = _generate(compiler, spec, vocab, seed=11, temperature=1.0)
    prompt = [7, 8, 9]
    context = prompt + out
    for cut in (len(prompt), len(prompt) + 1, len(context) // 2, len(context) - 1):
        stepwise = compiler.state(spec, num_prompt=len(prompt))
        stepwise.feed(0, torch.tensor(prompt))
        for pos in range(len(prompt), cut):
            stepwise.feed(pos, torch.tensor([context[pos]]))
        rebuilt = compiler.state(spec, num_prompt=len(prompt))
        rebuilt.feed(0, torch.tensor(context[:cut]))  # history and re-prefilled tokens in one go
        assert _allowed(compiler, rebuilt, vocab) == _allowed(compiler, stepwise, vocab)
        # Feeding a position twice (a step retried after a failed batch) changes nothing.
        rebuilt.feed(cut - 1, torch.tensor([context[cut - 1]]))
        assert _allowed(compiler, rebuilt, vocab) == _allowed(compiler, stepwise, vocab)


def test_a_grammar_that_does_not_build_fails_its_row_alone(compiler, vocab):
    bad = compiler.state(GrammarSpec(kind="regex", spec="a(b"), num_prompt=1)
    good = compiler.state(GrammarSpec(kind="regex", spec="[ab]+"), num_prompt=1)
    for g in (bad, good):
        g.feed(0, torch.tensor([4]))
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(2))
    masks = compiler.masks([bad, good], vocab)
    got = sample(logits, [SamplingParams(), SamplingParams()], [0, 0], None, masks)
    assert list(got.errors) == [0] and got.errors[0].startswith("grammar:")
    assert got.tokens[1] in {bad_id for bad_id in range(vocab) if masks.bitmask[1, bad_id // 32] >> (bad_id % 32) & 1}


def test_a_token_the_grammar_does_not_allow_or_a_gap_in_the_outputs_fails_the_row(compiler, tok, vocab):
    g = compiler.state(GrammarSpec(kind="regex", spec="[0-9]+"), num_prompt=1)
    g.feed(0, torch.tensor([4, tok.token_to_id("a")]))
    assert compiler.masks([g], vocab).errors[0] == GRAMMAR_DEAD_END  # our words; the log has the library's
    gap = compiler.state(GrammarSpec(kind="regex", spec="[0-9]+"), num_prompt=1)
    gap.feed(3, torch.tensor([tok.token_to_id("1")]))  # outputs at positions 1 and 2 never came
    assert "missed output tokens" in compiler.masks([gap], vocab).errors[0]


def test_each_grammar_is_built_once_while_cached(tok, vocab, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(tok.to_str())
    c = GrammarCompiler(path, vocab, [EOS], size=2)
    try:
        specs = [GrammarSpec(kind="regex", spec=f"[0-{i}]+") for i in range(3)]
        for s in specs[:2] * 3:
            c.prepare(s).result()
        assert c.builds == 2
        c.prepare(specs[2]).result()  # evicts the least recently used (specs[0])
        c.prepare(specs[1]).result()
        assert c.builds == 3
        c.prepare(specs[0]).result()
        assert c.builds == 4
    finally:
        c.close()


def test_without_a_tokenizer_json_a_constrained_row_fails_with_the_reason(vocab, tmp_path):
    c = GrammarCompiler(tmp_path / "missing" / "tokenizer.json", vocab, [EOS])
    try:
        g = c.state(GrammarSpec(kind="regex", spec="a"), num_prompt=1)
        masks = c.masks([g], vocab)
        assert "tokenizer.json" in masks.errors[0]
    finally:
        c.close()


def test_a_reset_past_the_prompt_rebuilds_the_matcher_from_the_history_it_is_sent(compiler, tok, vocab):
    # What the worker gets when a retracted (or requeued) constrained request is re-admitted with
    # part of its output served from the prefix cache: a fresh table, its history, then new tokens.
    from himamba.common.messages import SeqPlan
    from himamba.common.wire import WireError
    from himamba.services.worker.page_tables import PageTables

    spec = GrammarSpec(kind="regex", spec="[0-9]{6}")
    prompt = [5, 6, 7]
    digits = [tok.token_to_id(c) for c in "1234"]
    sampling = SamplingParams(grammar=spec)
    tables = PageTables(page_size=4, num_pages=8, vocab_size=vocab, device=torch.device("cpu"), grammars=compiler)
    prefix = len(prompt) + 3  # three outputs cached, the fourth is this step's new token
    plan = SeqPlan(
        "r", prefix_len=prefix, new_len=1, state_slot=0, reset=True, num_new_pages=2, sampling=sampling,
        history=prompt + digits[:3], num_prompt=len(prompt),
    )  # fmt: skip
    state = tables.update(plan, torch.tensor([0, 1]))
    assert state.grammar is not None
    state.grammar.feed(prefix, torch.tensor(digits[3:]))
    assert {tok.decode([t]) for t in _allowed(compiler, state.grammar, vocab)} == set("0123456789")
    state.grammar.feed(prefix + 1, torch.tensor([digits[0], digits[1]]))  # six digits: complete
    assert _allowed(compiler, state.grammar, vocab) == {EOS}
    without_history = msgspec.structs.replace(plan, history=[])
    with pytest.raises(WireError, match="needs its history"):
        tables.update(without_history, torch.tensor([0, 1]))


def test_the_scheduler_sends_a_constrained_sequence_its_history_only_past_its_prompt():
    from himamba.services.scheduler.request import Req
    from himamba.services.scheduler.worker_batch import _needs_history

    constrained = SamplingParams(grammar=GrammarSpec(kind="regex", spec="[0-9]+"))
    req = Req("r", [1, 2, 3], constrained, max_tokens=10, eos_ids=frozenset({0}), output_ids=[4, 5])
    assert not _needs_history(req, 3)  # the prompt alone is cached: the outputs are fed as new tokens
    assert _needs_history(req, 4)
    plain = Req("p", [1, 2, 3], SamplingParams(), max_tokens=10, eos_ids=frozenset({0}), output_ids=[4, 5])
    assert not _needs_history(plain, 4)


def test_masks_computed_in_parallel_equal_those_computed_one_by_one(compiler, vocab):
    specs = [
        GrammarSpec(kind="regex", spec=r"[0-9]{2}x"),
        GrammarSpec(kind="json_object"),
        GrammarSpec(kind="choice", spec='["yes"]'),
    ]
    states = [compiler.state(specs[i % 3], num_prompt=1) for i in range(6)]
    for g in states:
        g.feed(0, torch.tensor([4]))
    before = compiler.parallel_min_rows
    try:
        compiler.parallel_min_rows = 0
        one_by_one = compiler.masks([None, *states], vocab)
        compiler.parallel_min_rows = 2
        parallel = compiler.masks([None, *states], vocab)
    finally:
        compiler.parallel_min_rows = before
    assert one_by_one.rows == parallel.rows == list(range(1, 7))
    assert torch.equal(one_by_one.bitmask, parallel.bitmask)


def _recording(monkeypatch, name: str) -> list[str]:
    """Replace grammar_masks.`name` by itself plus a record of the threads it ran on."""
    import threading

    from himamba.services.worker import grammar_masks

    real, threads = getattr(grammar_masks, name), []

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(grammar_masks, name, recorded)
    return threads


def test_the_step_path_only_copies_a_matcher_built_from_the_front_doors_lowered_grammar(
    tok, vocab, tmp_path, monkeypatch
):
    """Structural: with PrepareGrammar's lowered text the worker converts no spec (the Python
    work that holds the GIL), builds on its grammar thread, and a step's matcher is a copy of the
    template: the step's own thread builds nothing and waits for nothing."""
    import threading

    from himamba.common.grammar import grammar_text

    path = tmp_path / "tokenizer.json"
    path.write_text(tok.to_str())
    built = _recording(monkeypatch, "matcher_from_text")
    converted = _recording(monkeypatch, "new_matcher")
    c = GrammarCompiler(path, vocab, [EOS])
    try:
        spec = GrammarSpec(kind="json_schema", spec=json.dumps(SCHEMA))
        c.prepare(spec, grammar_text(spec)).result()  # PrepareGrammar, then GrammarReady
        states = [c.state(spec, num_prompt=1) for _ in range(3)]  # the step: three sequences of it
        for g in states:
            g.feed(0, torch.tensor([5]))
        masks = c.masks([states[0], None, states[1], states[2]], vocab)
        assert masks is not None and masks.rows == [0, 2, 3] and not masks.errors
        step_thread = threading.current_thread().name
        assert converted == [] and c.conversions == 0  # no spec was converted in the worker
        assert len(built) == 1 and built[0].startswith("grammar") and built[0] != step_thread
        assert c.builds == 1 and c.step_waits == 0
        # A grammar with no lowered text (a restarted worker) is converted, on the grammar thread too.
        other = GrammarSpec(kind="regex", spec="[ab]{2,4}")
        c.prepare(other).result()
        assert converted == [built[0]] and c.conversions == 1
    finally:
        c.close()
