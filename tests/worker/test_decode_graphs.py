"""The decode step through DecodeGraphs' static buffers (what a CUDA graph replays) gives what a fresh
eager step gives: padded to the captured size, with other contents left in the buffers by an earlier,
larger step, and with padding that never touches a real sequence's KV or state."""

from __future__ import annotations

import torch

from himamba.services.worker.decode_graphs import DecodeGraphs, capture_sizes, scratch_rows
from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.loader import load_model
from himamba.services.worker.pools import KVPool, StatePool
from tests.e2e.prompts import random_tokens
from tests.worker.harness import Harness
from tests.worker.hf_reference import HF_VOCAB, save_tiny

PAGE, PAGES, SLOTS, MAX_LEN = 16, 64, 16, 256


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(128) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128]
    assert capture_sizes(300)[-3:] == [256, 288, 300]


def _twins(tmp_path, family: str):
    """Two harnesses over the same model and the same prefilled sequences: one decodes eagerly, one
    through the buffers. Pools carry one page and one slot past what the harness hands out."""
    save_tiny(family, tmp_path)
    model = load_model(tmp_path, "cpu", torch.float32)
    prompts = [random_tokens(n, seed=i, vocab=HF_VOCAB) for i, n in enumerate([5, 19, 40])]
    sides = []
    for _ in range(2):
        h = Harness(model, page_size=PAGE, num_pages=PAGES, num_state_slots=SLOTS)
        h.kv = KVPool(model.kv_spec(), PAGES + 1, PAGE, h.device)
        h.state = StatePool(model.state_spec(), SLOTS + 1, h.device)
        seqs = [h.new_sequence() for _ in prompts]
        h.prefill(seqs, prompts)
        sides.append((h, seqs))
    return model, sides


def test_buffers_give_what_a_fresh_step_gives(tmp_path):
    model, [(eager, eager_seqs), (buffered, buffered_seqs)] = _twins(tmp_path, "NemotronH")
    graphs = DecodeGraphs(
        model, buffered.kv, buffered.state, scratch_rows(PAGES, PAGE, SLOTS), max_batch=8, max_len=MAX_LEN,
        device=torch.device("cpu"),
    )  # fmt: skip
    tokens = [3, 7, 11]
    for step in range(4):
        # Step 0 runs all three (padded to 4); later steps drop the first sequence, so the buffers hold
        # a larger step's rows past the batch, and the padded size changes (4 -> 2).
        ids = tokens if step == 0 else tokens[1:]
        e_seqs, b_seqs = (eager_seqs, buffered_seqs) if step == 0 else (eager_seqs[1:], buffered_seqs[1:])
        want = eager.decode(e_seqs, ids)
        batch, _ = _decode_batch_no_run(buffered, b_seqs, ids)
        got = graphs.run(batch)
        assert got is not None and graphs.padded_size(batch) == (4 if step == 0 else 2)
        for s in b_seqs:
            s.length += 1
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        tokens = [t + 1 for t in tokens]
    # The pools' real rows equal the eager side's: padding wrote only the scratch page and slot.
    for layer_e, layer_b in zip(eager.state.tensors, buffered.state.tensors, strict=True):
        for name in layer_e:
            torch.testing.assert_close(layer_b[name][:SLOTS], layer_e[name][:SLOTS], rtol=0, atol=0)
    for k_e, k_b in zip(eager.kv.k, buffered.kv.k, strict=True):
        torch.testing.assert_close(k_b[: PAGES * PAGE], k_e[: PAGES * PAGE], rtol=0, atol=0)


def _decode_batch_no_run(h: Harness, seqs, tokens):
    """Harness.decode's batch for `seqs`, built without running the model (lengths left as they are)."""
    max_len = max(s.length for s in seqs) + 1
    table = torch.zeros(len(seqs), max_len, dtype=torch.int64)
    write = []
    for i, seq in enumerate(seqs):
        slots = h.token_slots(seq, 0, seq.length + 1)
        table[i, : len(slots)] = torch.tensor(slots)
        write.append(slots[-1])
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    batch = ForwardBatch(
        mode="decode",
        input_ids=t(tokens),
        positions=t([s.length for s in seqs]),
        new_lens=[1] * len(seqs),
        prefix_lens=[s.length for s in seqs],
        write_slots=t(write),
        slot_table=table,
        seq_lens=t([s.length + 1 for s in seqs]),
        state_slots=t([s.state_slot for s in seqs]),
    )
    return batch, None


def test_batches_the_buffers_cannot_hold_run_eagerly(tmp_path):
    model, [(h, seqs), _] = _twins(tmp_path, "NemotronH")
    graphs = DecodeGraphs(model, h.kv, h.state, scratch_rows(PAGES, PAGE, SLOTS), max_batch=2, max_len=MAX_LEN,
                          device=torch.device("cpu"))  # fmt: skip
    batch, _ = _decode_batch_no_run(h, seqs, [1, 2, 3])
    assert graphs.padded_size(batch) is None and graphs.run(batch) is None  # 3 > the largest size, 2
    small, _ = _decode_batch_no_run(h, seqs[:2], [1, 2])
    small.logit_rows = torch.tensor([0, 1])
    assert graphs.padded_size(small) is None  # other rows' logits: eager
    narrow = DecodeGraphs(model, h.kv, h.state, scratch_rows(PAGES, PAGE, SLOTS), max_batch=4, max_len=8,
                          device=torch.device("cpu"))  # fmt: skip
    small.logit_rows = None
    assert narrow.padded_size(small) is None  # contexts longer than the table: eager


def test_warm_up_prefills_touch_only_the_scratch_rows(tmp_path):
    from himamba.services.worker.warmup import warm_up_prefill

    model, [(h, _), _] = _twins(tmp_path, "NemotronH")
    state_before = [{k: t.clone() for k, t in layer.items()} for layer in h.state.tensors]
    kv_before = [k.clone() for k in h.kv.k]
    scratch = scratch_rows(PAGES, PAGE, SLOTS)
    assert warm_up_prefill(model, h.kv, h.state, scratch, PAGE, torch.device("cpu")) > 0
    for layer, before in zip(h.state.tensors, state_before, strict=True):
        for name, t in layer.items():
            assert torch.equal(t, before[name])  # the scratch slot is zeroed again; the rest untouched
    for k, before in zip(h.kv.k, kv_before, strict=True):
        assert torch.equal(k[: PAGES * PAGE], before[: PAGES * PAGE])
        assert k[PAGES * PAGE :].abs().sum() > 0  # the warm-up wrote its K into the scratch page
