"""Paged attention (prefill of one sequence or a packed batch, decode) and write_kv against a per-query
float64 softmax."""

from __future__ import annotations

import pytest
import torch

from himamba.kernels import (
    make_varlen,
    paged_attention_decode,
    paged_attention_prefill,
    paged_attention_prefill_varlen,
    segmented,
    write_kv,
)
from himamba.kernels.native import attention as native_attention
from himamba.kernels.reference import attention as reference_attention

# Each test runs on the PyTorch reference and on the native CPU kernel (tests/kernels/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_kernels")

POOL = 300
DH = 16


def naive_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One query q [Hq, Dh] over keys/values [L, Hkv, Dh] (all visible), float64."""
    rep = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(rep, dim=1)  # [L, Hq, Dh]
    v = values.double().repeat_interleave(rep, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) * scale
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


def make_pool(kv_heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(POOL, kv_heads, DH, generator=g), torch.randn(POOL, kv_heads, DH, generator=g), g


@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (8, 2), (4, 1)])
@pytest.mark.parametrize("prefix_len", [0, 5, 40])
@pytest.mark.parametrize("new_len", [1, 7, 33])
def test_prefill_matches_naive(q_heads: int, kv_heads: int, prefix_len: int, new_len: int) -> None:
    k_cache, v_cache, g = make_pool(kv_heads, seed=prefix_len * 100 + new_len)
    slots = torch.randperm(POOL, generator=g)[: prefix_len + new_len]  # scattered through the pool
    new_k = torch.randn(new_len, kv_heads, DH, generator=g)
    new_v = torch.randn(new_len, kv_heads, DH, generator=g)
    q = torch.randn(new_len, q_heads, DH, generator=g)
    scale = DH**-0.5
    with torch.inference_mode():
        write_kv(k_cache, v_cache, slots[prefix_len:], new_k, new_v)
        out = paged_attention_prefill(q, k_cache, v_cache, slots, prefix_len, scale)
    assert out.shape == (new_len, q_heads, DH) and out.dtype == torch.float32
    keys, values = k_cache[slots], v_cache[slots]
    visible = [prefix_len + i + 1 for i in range(new_len)]
    want = torch.stack([naive_attend(q[i], keys[:n], values[:n], scale) for i, n in enumerate(visible)])
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_prefill_with_prefix_equals_tail_of_full_prefill() -> None:
    k_cache, v_cache, g = make_pool(2, seed=1)
    slots = torch.randperm(POOL, generator=g)[:30]
    q = torch.randn(30, 4, DH, generator=g)
    full = paged_attention_prefill(q, k_cache, v_cache, slots, 0, 0.3)
    tail = paged_attention_prefill(q[12:], k_cache, v_cache, slots, 12, 0.3)
    torch.testing.assert_close(tail, full[12:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (8, 2)])
def test_decode_ragged_batch_matches_naive(q_heads: int, kv_heads: int) -> None:
    k_cache, v_cache, g = make_pool(kv_heads, seed=q_heads)
    lens = [1, 9, 23, 4]
    max_len = 25
    table = torch.zeros(len(lens), max_len, dtype=torch.int64)  # padded with slot 0
    order = torch.randperm(POOL, generator=g)
    rows = []
    start = 0
    for b, n in enumerate(lens):
        rows.append(order[start : start + n])
        table[b, :n] = rows[-1]
        start += n
    q = torch.randn(len(lens), q_heads, DH, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    with torch.inference_mode():
        out = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.25)
    assert out.shape == (len(lens), q_heads, DH)
    for b, row in enumerate(rows):
        want = naive_attend(q[b], k_cache[row], v_cache[row], 0.25)
        torch.testing.assert_close(out[b].double(), want, rtol=1e-5, atol=1e-5)


def test_decode_ignores_padding_slots() -> None:
    k_cache, v_cache, g = make_pool(2, seed=3)
    table = torch.randperm(POOL, generator=g)[:12].view(2, 6)
    seq_lens = torch.tensor([3, 6])
    q = torch.randn(2, 4, DH, generator=g)
    before = paged_attention_decode(q, k_cache, v_cache, table, seq_lens, 0.2)
    other = table.clone()
    other[0, 3:] = torch.tensor([7, 8, 9])
    after = paged_attention_decode(q, k_cache, v_cache, other, seq_lens, 0.2)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_decode_equals_last_row_of_prefill() -> None:
    k_cache, v_cache, g = make_pool(2, seed=4)
    slots = torch.randperm(POOL, generator=g)[:17]
    q = torch.randn(17, 8, DH, generator=g)
    prefill = paged_attention_prefill(q, k_cache, v_cache, slots, 0, 0.25)
    decode = paged_attention_decode(q[-1:], k_cache, v_cache, slots[None], torch.tensor([17]), 0.25)
    torch.testing.assert_close(decode[0], prefill[-1], rtol=1e-5, atol=1e-6)


def test_write_kv_touches_only_given_slots() -> None:
    k_cache, v_cache, g = make_pool(2, seed=5)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([299, 3, 150])
    k = torch.randn(3, 2, DH, generator=g)
    v = torch.randn(3, 2, DH, generator=g)
    write_kv(k_cache, v_cache, slots, k, v)
    torch.testing.assert_close(k_cache[slots], k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache[slots], v, rtol=0, atol=0)
    untouched = torch.ones(POOL, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], k_before[untouched])
    assert torch.equal(v_cache[untouched], v_before[untouched])


def test_bfloat16_preserves_dtype() -> None:
    k_cache, v_cache, g = make_pool(2, seed=6)
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    slots = torch.randperm(POOL, generator=g)[:10]
    q = torch.randn(10, 4, DH, generator=g).bfloat16()
    out = paged_attention_prefill(q[4:], k_cache, v_cache, slots, 4, 0.25)
    assert out.dtype == torch.bfloat16
    want = torch.stack([naive_attend(q[n - 1], k_cache[slots[:n]], v_cache[slots[:n]], 0.25) for n in range(5, 11)])
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    dec = paged_attention_decode(q[:2], k_cache, v_cache, slots.view(2, 5), torch.tensor([5, 3]), 0.25)
    assert dec.dtype == torch.bfloat16


def test_bad_input_raises_value_error() -> None:
    k_cache, v_cache, g = make_pool(2, seed=7)
    q = torch.randn(4, 4, DH, generator=g)
    slots = torch.arange(6)
    with pytest.raises(ValueError, match="seq_slots"):
        paged_attention_prefill(q, k_cache, v_cache, slots, 1, 0.25)
    with pytest.raises(ValueError, match="prefix_len"):
        paged_attention_prefill(q, k_cache, v_cache, slots, -1, 0.25)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_prefill(torch.randn(4, 3, DH), k_cache, v_cache, slots[:4], 0, 0.25)
    with pytest.raises(ValueError, match="seq_slots"):
        paged_attention_prefill(q, k_cache, v_cache, slots[:4].int(), 0, 0.25)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention_decode(q[:2], k_cache, v_cache, slots.view(2, 3), torch.tensor([3, 4]), 0.25)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention_decode(q[:2], k_cache, v_cache, slots.view(2, 3), torch.tensor([0, 2]), 0.25)
    with pytest.raises(ValueError, match="k and v"):
        write_kv(k_cache, v_cache, slots[:2], torch.randn(3, 2, DH), torch.randn(3, 2, DH))


# A packed batch: lengths that are and are not multiples of the blocks (32 query tokens, 64 context
# rows), prefixes of 0 and more, and a sequence with no new tokens.
NEW_LENS = (1, 31, 33, 64, 65, 0, 100)
PREFIX_LENS = (0, 40, 0, 7, 64, 9, 0)


def make_batch(
    q_heads: int,
    kv_heads: int,
    seed: int,
    new_lens: tuple[int, ...] = NEW_LENS,
    prefix_lens: tuple[int, ...] = PREFIX_LENS,
) -> tuple[torch.Tensor, ...]:
    """q [T, Hq, Dh], a pool of 1000 slots and a slot table [B, longest + 3] scattered through it (the
    padding columns hold valid slots, which no query may read)."""
    g = torch.Generator().manual_seed(seed)
    pool = 1000
    k_cache, v_cache = torch.randn(pool, kv_heads, DH, generator=g), torch.randn(pool, kv_heads, DH, generator=g)
    width = max(p + n for p, n in zip(prefix_lens, new_lens, strict=True)) + 3
    table = torch.randperm(pool, generator=g)[: len(new_lens) * width].view(len(new_lens), width)
    q = torch.randn(sum(new_lens), q_heads, DH, generator=g)
    return q, k_cache, v_cache, table


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (2, 2)])
def test_prefill_varlen_equals_each_sequence_alone(cpu_kernels: str, q_heads: int, kv_heads: int) -> None:
    q, k_cache, v_cache, table = make_batch(q_heads, kv_heads, seed=q_heads)
    v = make_varlen(NEW_LENS, PREFIX_LENS, [], q.device)
    scale = DH**-0.5
    with torch.inference_mode():
        out = paged_attention_prefill_varlen(q, k_cache, v_cache, table, v, scale)
    assert out.shape == q.shape and out.dtype == torch.float32
    by_reference = segmented.attention_prefill_varlen(
        reference_attention.paged_attention_prefill, q, k_cache, v_cache, table, v, scale
    )
    torch.testing.assert_close(out, by_reference, rtol=1e-5, atol=1e-5)
    start = 0
    for b, (prefix, n) in enumerate(zip(PREFIX_LENS, NEW_LENS, strict=True)):
        keys, values = k_cache[table[b]], v_cache[table[b]]
        for i in range(n):
            want = naive_attend(q[start + i], keys[: prefix + i + 1], values[: prefix + i + 1], scale)
            torch.testing.assert_close(out[start + i].double(), want, rtol=1e-5, atol=1e-5)
        start += n
    if cpu_kernels == "native":  # the same arithmetic per query block as the one-sequence kernel
        alone = segmented.attention_prefill_varlen(
            native_attention.paged_attention_prefill, q, k_cache, v_cache, table, v, scale
        )
        assert torch.equal(out, alone)


def test_prefill_varlen_is_one_native_call(cpu_kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for name in ("paged_attention_prefill", "paged_attention_prefill_varlen"):
        real = getattr(native_attention, name)
        monkeypatch.setattr(native_attention, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    q, k_cache, v_cache, table = make_batch(2, 1, seed=1)
    paged_attention_prefill_varlen(q, k_cache, v_cache, table, make_varlen(NEW_LENS, PREFIX_LENS, [], q.device), 0.3)
    assert calls == (["paged_attention_prefill_varlen"] if cpu_kernels == "native" else [])


@pytest.mark.parametrize("prefix_len,new_len", [(0, 100), (37, 1), (64, 65)])
def test_prefill_varlen_of_one_sequence_equals_the_one_sequence_kernel(prefix_len: int, new_len: int) -> None:
    q, k_cache, v_cache, table = make_batch(8, 2, seed=new_len, new_lens=(new_len,), prefix_lens=(prefix_len,))
    v = make_varlen((new_len,), (prefix_len,), [], q.device)
    out = paged_attention_prefill_varlen(q, k_cache, v_cache, table, v, 0.2)
    one = paged_attention_prefill(q, k_cache, v_cache, table[0, : prefix_len + new_len], prefix_len, 0.2)
    assert torch.equal(out, one)


def test_prefill_varlen_of_no_tokens_is_empty() -> None:
    q, k_cache, v_cache, table = make_batch(4, 2, seed=2, new_lens=(0, 0), prefix_lens=(3, 0))
    out = paged_attention_prefill_varlen(q, k_cache, v_cache, table, make_varlen((0, 0), (3, 0), [], q.device), 0.2)
    assert out.shape == (0, 4, DH)
