"""Every sequence's token slots are a row of one tensor: rows and columns grow as sequences arrive
and lengthen, a dropped sequence's row is reused, and a decode step's slot table is the gather of
its sequences' rows, equal to the slots each sequence was given."""

from __future__ import annotations

import random

import torch

from himamba.common.messages import SeqPlan
from himamba.common.types import SamplingParams
from himamba.services.worker.page_tables import PageTables

PAGE, NUM_PAGES = 4, 4096


def _grow(tables: PageTables, rid: str, reset: bool, start: int, pages: list[int], length: int):
    plan = SeqPlan(rid, length - 1 if not reset else 0, 1 if not reset else length, 0, reset=reset,
                   page_start=start, num_new_pages=len(pages), sampling=SamplingParams() if reset else None)  # fmt: skip
    return tables.update(plan, torch.tensor(pages, dtype=torch.int64))


def test_rows_grow_are_reused_and_gather_into_the_decode_table():
    rng = random.Random(0)
    tables = PageTables(PAGE, NUM_PAGES, vocab_size=16, device=torch.device("cpu"))
    free = list(range(NUM_PAGES))
    rng.shuffle(free)
    want: dict[str, list[int]] = {}
    lengths: dict[str, int] = {}
    for step in range(300):
        rid = f"s{rng.randrange(40)}"
        if rid in want and rng.random() < 0.1:
            tables.drop([rid])
            del want[rid], lengths[rid]
            continue
        if rid not in want:
            n = rng.randrange(1, 30)
            pages = [free.pop() for _ in range(-(-n // PAGE))]
            _grow(tables, rid, True, 0, pages, n)
            want[rid] = [p * PAGE + o for p in pages for o in range(PAGE)]
            lengths[rid] = n
        else:  # one more token, a page more when it crosses a page boundary
            n = lengths[rid] + 1
            have = len(want[rid]) // PAGE
            pages = [free.pop()] if n > have * PAGE else []
            _grow(tables, rid, False, have, pages, n)
            want[rid] += [p * PAGE + o for p in pages for o in range(PAGE)]
            lengths[rid] = n
        states = [tables.seqs[r] for r in want]
        width = max(lengths.values())
        table = tables.decode_table(states, width)
        for i, r in enumerate(want):
            assert table[i, : lengths[r]].tolist() == want[r][: lengths[r]], (step, r)
            assert tables.seqs[r].token_slots(lengths[r]).tolist() == want[r][: lengths[r]]
    assert tables.table.shape[0] >= len(want) and tables.table.shape[0] <= 64  # rows are reused, not leaked
    rows = [st.row for st in tables.seqs.values()]
    assert len(set(rows)) == len(rows)
    tables.clear()
    assert len(tables) == 0
