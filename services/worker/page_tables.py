"""Each running sequence's page table, kept by the worker between steps.

The scheduler sends only what changed (common/messages.py `SeqPlan`): a fresh table at a
sequence's first step after admission, then the pages appended (decode, Extend) or re-pointed
(an Insert that found the prefix already cached) since its last step. The token-slot view of a
table (what attention reads) is kept too and rewritten only from the first changed page, so a
step costs what changed, not the context length.

Every sequence's token slots are a row of one device tensor (`PageTables.table`, sglang's
req_to_token), so a decode step's [B, max_len] slot table is one gather of B rows, whatever B is,
instead of one copy per sequence. Rows and columns grow by doubling when the running sequences
need more (rare, and amortised); a dropped sequence's row is reused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from himamba.common.messages import SeqPlan
from himamba.common.types import SamplingParams
from himamba.common.wire import WireError
from himamba.services.worker.grammar_masks import GrammarCompiler, GrammarState
from himamba.services.worker.penalties import PenaltyState, host_values

log = logging.getLogger("himamba.worker")


@dataclass
class SeqState:
    """What the worker remembers of one running sequence."""

    num_pages: int
    sampling: SamplingParams
    penalties: PenaltyState | None
    num_prompt: int = 0  # context[:num_prompt] is the prompt
    # Prompt logprobs: the log-softmax of a prefill chunk's last row, which predicts the next
    # chunk's first token (worker/logprobs.py).
    pending_prompt_row: torch.Tensor | None = None
    grammar: GrammarState | None = None  # structured outputs: the sequence's matcher
    row: int = -1  # its row of `tables.table`, the token slots
    tables: PageTables | None = field(default=None, repr=False)

    @property
    def slots(self) -> torch.Tensor:
        """Token slots of its pages (valid: the first num_pages * page_size), a view of its row."""
        assert self.tables is not None
        return self.tables.table[self.row]

    def token_slots(self, length: int) -> torch.Tensor:
        return self.slots[:length]


class PageTables:
    """Sequences by rid; updated from each RunBatch before its forward."""

    def __init__(
        self,
        page_size: int,
        num_pages: int,
        vocab_size: int,
        device: torch.device,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.page_size = page_size
        self.grammars = grammars
        # False on a tensor-parallel follower rank: it samples nothing, so it keeps no grammar matchers
        # (rank 0 alone prepared the grammars; masks are a sampling matter).
        self.samples = True
        self.num_pages = num_pages
        self.vocab_size = vocab_size
        self.device = device
        self.seqs: dict[str, SeqState] = {}
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=device)
        self.table = torch.zeros((8, 8 * page_size), dtype=torch.int64, device=device)
        self._free_rows = list(range(7, -1, -1))

    def __len__(self) -> int:
        return len(self.seqs)

    def drop(self, rids: list[str]) -> None:
        for rid in rids:
            state = self.seqs.pop(rid, None)
            if state is not None:
                self._free_rows.append(state.row)

    def clear(self) -> None:
        """A new scheduler: nothing it will send refers to an earlier one's sequences."""
        self.seqs.clear()
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))

    def decode_table(self, states: list[SeqState], width: int) -> torch.Tensor:
        """[B, width] token slots of `states`' rows: one gather (the row ids go to the device
        without waiting for it)."""
        rows = torch.tensor([st.row for st in states], dtype=torch.int64).to(self.device, non_blocking=True)
        return self.table[:, :width].index_select(0, rows)

    def _take_row(self) -> int:
        if not self._free_rows:
            n = self.table.shape[0]
            grown = torch.zeros((2 * n, self.table.shape[1]), dtype=torch.int64, device=self.device)
            grown[:n] = self.table
            self.table = grown
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _fit_columns(self, tokens: int) -> None:
        cols = self.table.shape[1]
        if tokens > cols:
            width = max(tokens, 2 * cols)
            grown = torch.zeros((self.table.shape[0], width), dtype=torch.int64, device=self.device)
            grown[:, :cols] = self.table
            self.table = grown

    def _grammar_state(self, plan: SeqPlan) -> GrammarState:
        """A fresh matcher, brought up to date with the outputs already in the cached context."""
        assert plan.sampling is not None and plan.sampling.grammar is not None
        if self.grammars is None:
            raise WireError(f"{plan.rid}: structured outputs asked of a worker without a grammar engine")
        g = self.grammars.state(plan.sampling.grammar, plan.num_prompt)
        if plan.prefix_len > plan.num_prompt:  # outputs served from the cache: they come as history
            if len(plan.history) != plan.prefix_len:
                raise WireError(f"{plan.rid}: a constrained sequence reset past its prompt needs its history")
            g.feed(0, torch.tensor(plan.history, dtype=torch.int64))
            log.info("%s: grammar matcher rebuilt from %d output tokens", plan.rid, g.seen)
        return g

    def check_pages(self, plan: SeqPlan, host_pages: Sequence[int]) -> None:
        """Raise WireError unless one sequence's new pages (its slice of the batch's pages, read on the
        host: reading a device copy would cost a synchronisation per sequence) are in range."""
        if len(host_pages) and (min(host_pages) < 0 or max(host_pages) >= self.num_pages):
            raise WireError(f"{plan.rid}: page index out of range")

    def update(self, plan: SeqPlan, new_pages: torch.Tensor) -> SeqState:
        """Apply one sequence's delta (`new_pages`: its new pages, on the worker's device, already
        checked by `check_pages`)."""
        return self.update_all([plan], new_pages)[0]

    def update_all(self, plans: Sequence[SeqPlan], pages: torch.Tensor) -> list[SeqState]:
        """Apply every sequence's delta of a batch (`pages`: the batch's pages tensor on the worker's
        device, each plan's new pages in turn, already checked by `check_pages`). The token slots of all
        new pages are written in one scatter, whatever the number of sequences."""
        states: list[SeqState] = []
        rows: list[int] = []
        cols: list[int] = []
        try:
            for plan in plans:
                state = self._apply(plan)
                k = plan.num_new_pages
                rows += [state.row] * k
                cols += range(plan.page_start, plan.page_start + k)
                states.append(state)
        finally:
            # What was applied is written, also when a later sequence was refused.
            if rows:
                ps = self.page_size
                index = host_values(rows + cols, torch.int64, self.device).view(2, -1)
                by_page = self.table.view(self.table.shape[0], -1, ps)
                by_page.index_put_((index[0], index[1]), pages[: len(rows)].view(-1, 1) * ps + self._offsets)
        return states

    def _apply(self, plan: SeqPlan) -> SeqState:
        """One sequence's delta but its token slots: validation, a fresh table on reset, columns and
        page count (the caller writes the slots)."""
        if plan.reset:
            if plan.page_start != 0 or plan.sampling is None:
                raise WireError(f"{plan.rid}: a fresh page table starts at 0 with its sampling parameters")
            pen = None
            if plan.sampling.penalised:
                pen = PenaltyState(self.vocab_size, plan.num_prompt, self.device)
                pen.feed(plan.history)
            grammar = self._grammar_state(plan) if plan.sampling.grammar is not None and self.samples else None
            old = self.seqs.pop(plan.rid, None)
            if old is not None:  # a reset of a running sequence: its row is taken afresh
                self._free_rows.append(old.row)
            state = SeqState(0, plan.sampling, pen, plan.num_prompt, grammar=grammar, row=self._take_row(), tables=self)
            self.seqs[plan.rid] = state
        else:
            got = self.seqs.get(plan.rid)
            if got is None:
                raise WireError(f"{plan.rid}: no page table (its first step must reset one)")
            state = got
            if plan.page_start > state.num_pages:
                raise WireError(f"{plan.rid}: page delta at {plan.page_start} past its {state.num_pages} pages")
        k = plan.num_new_pages
        if k:
            end = plan.page_start + k
            self._fit_columns(end * self.page_size)
            state.num_pages = max(state.num_pages, end)
        if state.num_pages * self.page_size < plan.prefix_len + plan.new_len:
            raise WireError(f"{plan.rid}: {state.num_pages} pages cannot hold {plan.prefix_len + plan.new_len} tokens")
        return state
