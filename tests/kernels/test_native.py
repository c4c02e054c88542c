"""The native CPU kernels (kernels/native) against their PyTorch references, and how they are built and chosen."""

from __future__ import annotations

import math

import pytest
import torch

from himamba.kernels import dispatch
from himamba.kernels.native import attention as native_attention
from himamba.kernels.native import build
from himamba.kernels.native import conv1d as native_conv1d
from himamba.kernels.native import norm as native_norm
from himamba.kernels.native import ssd as native_ssd
from himamba.kernels.reference import attention, conv1d, norm, ssd

pytestmark = pytest.mark.skipif(
    build.native_build().library is None, reason=f"native kernels {build.native_build().detail}"
)


def _slot_table(gen: torch.Generator, lens: list[int], page: int, pages: int) -> torch.Tensor:
    """Each sequence's token slots, page by page from a shuffled pool, padded with a valid slot."""
    perm = torch.randperm(pages, generator=gen)
    width = max(lens) + 3
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    used = 0
    for b in range(len(lens)):
        need = -(-width // page)
        slots = (perm[used : used + need, None] * page + torch.arange(page)).reshape(-1)[:width]
        used += need
        table[b] = slots
    return table


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim"),
    [(8, 2, 64), (4, 4, 16), (6, 2, 24), (12, 2, 32), (5, 1, 40), (16, 2, 128)],
)
def test_decode_attention_matches_reference(q_heads: int, kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(q_heads * 100 + head_dim)
    lens = [1, 7, 16, 33, 200]  # partial and whole 16-score blocks, a lone token
    table = _slot_table(gen, lens, page=16, pages=80)
    k_cache = torch.randn(80 * 16, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(80 * 16, kv_heads, head_dim, generator=gen)
    q = torch.randn(len(lens), q_heads, head_dim, generator=gen) * 3  # peaked softmaxes too
    seq_lens = torch.tensor(lens)
    scale = 1 / math.sqrt(head_dim)
    want = attention.paged_attention_decode(q, k_cache, v_cache, table, seq_lens, scale)
    got = native_attention.paged_attention_decode(q, k_cache, v_cache, table, seq_lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(8, 2, 64), (6, 2, 24), (4, 4, 16)])
def test_decode_attention_of_a_sequence_alone_equals_it_in_a_batch(q_heads: int, kv_heads: int, head_dim: int) -> None:
    """A batch's task is a sequence with all its heads, a lone sequence's tasks are its kv heads: the
    same products in the same order, so a sequence's output does not depend on its batch."""
    gen = torch.Generator().manual_seed(7 * q_heads + head_dim)
    lens = [200, 33, 1]
    table = _slot_table(gen, lens, page=16, pages=40)
    k_cache = torch.randn(40 * 16, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(40 * 16, kv_heads, head_dim, generator=gen)
    q = torch.randn(len(lens), q_heads, head_dim, generator=gen) * 3
    batched = native_attention.paged_attention_decode(q, k_cache, v_cache, table, torch.tensor(lens), 0.125)
    for b, n in enumerate(lens):
        alone = native_attention.paged_attention_decode(
            q[b : b + 1], k_cache, v_cache, table[b : b + 1, :n], torch.tensor([n]), 0.125
        )
        torch.testing.assert_close(alone[0], batched[b], rtol=0, atol=0)
    want = attention.paged_attention_decode(q[:1], k_cache, v_cache, table[:1], torch.tensor(lens[:1]), 0.125)
    torch.testing.assert_close(batched[:1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("tokens", "prefix", "q_heads", "kv_heads", "head_dim"),
    [
        (512, 0, 8, 2, 64),
        (37, 100, 6, 2, 24),
        (1, 0, 4, 4, 16),
        (70, 5, 8, 1, 64),
        (33, 64, 3, 3, 8),
        (100, 0, 12, 4, 128),
    ],
)
def test_prefill_attention_matches_reference(
    tokens: int, prefix: int, q_heads: int, kv_heads: int, head_dim: int
) -> None:
    """Query blocks of 32 tokens and context blocks of 64, cut anywhere; a cached prefix or none."""
    gen = torch.Generator().manual_seed(tokens + prefix)
    slots_in_pool = 3 * (tokens + prefix) + 7
    k_cache = torch.randn(slots_in_pool, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(slots_in_pool, kv_heads, head_dim, generator=gen)
    seq_slots = torch.randperm(slots_in_pool, generator=gen)[: prefix + tokens]
    q = torch.randn(tokens, q_heads, head_dim, generator=gen) * 2
    scale = 1 / math.sqrt(head_dim)
    want = attention.paged_attention_prefill(q, k_cache, v_cache, seq_slots, prefix, scale)
    got = native_attention.paged_attention_prefill(q, k_cache, v_cache, seq_slots, prefix, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_prefill_attention_refuses_a_slot_outside_the_pool() -> None:
    k_cache = torch.randn(16, 1, 8)
    with pytest.raises(ValueError, match="outside the pool's 16"):
        native_attention.paged_attention_prefill(torch.randn(2, 2, 8), k_cache, k_cache, torch.tensor([3, 16]), 0, 1.0)


def test_decode_attention_far_below_the_maximum_gets_zero_weight() -> None:
    """Scores hundreds below the row's maximum (exp underflows) weigh nothing, as in the reference."""
    k_cache = torch.zeros(32, 1, 16)
    v_cache = torch.arange(32.0)[:, None, None].expand(32, 1, 16).contiguous()
    k_cache[5] = 1.0  # the one key the query favours
    q = torch.full((1, 1, 16), 40.0)
    table = torch.arange(32)[None]
    got = native_attention.paged_attention_decode(q, k_cache, v_cache, table, torch.tensor([32]), 1.0)
    want = attention.paged_attention_decode(q, k_cache, v_cache, table, torch.tensor([32]), 1.0)
    torch.testing.assert_close(got, want)
    assert got[0, 0, 0].item() == pytest.approx(5.0)


def test_decode_attention_refuses_a_slot_outside_the_pool() -> None:
    k_cache = torch.randn(32, 2, 16)
    q = torch.randn(2, 4, 16)
    table = torch.tensor([[0, 1, 2, 3], [4, 5, 32, 7]])
    with pytest.raises(ValueError, match="outside the pool's 32"):
        dispatch.paged_attention_decode(q, k_cache, k_cache, table, torch.tensor([4, 3]), 0.25)
    table[1, 2] = -1
    with pytest.raises(ValueError, match="outside the pool's 32"):
        dispatch.paged_attention_decode(q, k_cache, k_cache, table, torch.tensor([4, 4]), 0.25)
    # Slots past a sequence's length are never read, so they may be anything.
    out = dispatch.paged_attention_decode(q, k_cache, k_cache, table, torch.tensor([4, 2]), 0.25)
    assert torch.isfinite(out).all()


def _projection_views(gen: torch.Generator, batch: int, heads: int, head_dim: int, groups: int, n: int):
    """x, dt, B, C as the model has them: views into the rows of one projection's output."""
    widths = [heads * head_dim, groups * n, groups * n, heads]
    out = torch.randn(batch, sum(widths) + 5, generator=gen)
    x, b, c, dt, _ = out.split([*widths, 5], dim=-1)
    return x.reshape(batch, heads, head_dim), dt, b.reshape(batch, groups, n), c.reshape(batch, groups, n)


@pytest.mark.parametrize(
    ("heads", "head_dim", "groups", "n", "bias", "softplus", "limit", "skip"),
    [
        (16, 64, 2, 64, True, True, (0.0, math.inf), True),
        (4, 8, 1, 16, False, True, (0.0, math.inf), False),
        (6, 12, 3, 8, True, False, (0.0, math.inf), True),
        (8, 16, 2, 32, True, True, (0.01, 0.5), True),
    ],
)
def test_state_update_matches_reference(heads, head_dim, groups, n, bias, softplus, limit, skip) -> None:
    gen = torch.Generator().manual_seed(heads * head_dim + n)
    batch = 5
    x, dt, B, C = _projection_views(gen, batch, heads, head_dim, groups, n)
    A = -torch.rand(heads, generator=gen) * 4
    D = torch.randn(heads, generator=gen) if skip else None
    dt_bias = torch.randn(heads, generator=gen) if bias else None
    state = torch.randn(batch, heads, head_dim, n, generator=gen)
    want_state = state.clone()
    want = ssd.selective_state_update(want_state, x, dt, A, B, C, D, dt_bias, softplus, limit)
    got = native_ssd.selective_state_update(state, x, dt, A, B, C, D, dt_bias, softplus, limit)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("width", "bias", "activation"), [(4, True, "silu"), (2, False, None), (1, True, "silu")])
def test_conv_update_matches_reference(width: int, bias: bool, activation: str | None) -> None:
    gen = torch.Generator().manual_seed(width)
    batch, channels = 3, 40
    rows = torch.randn(batch, channels + 7, generator=gen)
    x = rows[:, 3 : 3 + channels]  # rows lie apart, as a projection's split does
    weight = torch.randn(channels, width, generator=gen)
    b = torch.randn(channels, generator=gen) if bias else None
    state = torch.randn(batch, channels, width - 1, generator=gen)
    want_state = state.clone()
    want = conv1d.causal_conv1d_update(x, want_state, weight, b, activation)
    got = native_conv1d.causal_conv1d_update(x, state, weight, b, activation)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(state, want_state)  # the window shift is exact


@pytest.mark.parametrize(
    ("length", "channels", "width", "initial", "bias", "activation"),
    [
        (512, 1280, 4, False, True, "silu"),
        (2, 40, 4, True, True, "silu"),
        (33, 21, 2, True, False, None),
        (5, 16, 1, False, True, "silu"),
    ],
)
def test_conv_over_a_segment_matches_reference(length, channels, width, initial, bias, activation) -> None:
    """Time-major inputs (a projection's rows seen as [B, D, L]), segments shorter than the window too."""
    gen = torch.Generator().manual_seed(length + channels)
    rows = torch.randn(2, length, channels + 9, generator=gen)
    x = rows[:, :, 4 : 4 + channels].transpose(1, 2)
    weight = torch.randn(channels, width, generator=gen)
    b = torch.randn(channels, generator=gen) if bias else None
    init = torch.randn(2, channels, width - 1, generator=gen) if initial else None
    want = conv1d.causal_conv1d(x, weight, b, init, activation)
    got = native_conv1d.causal_conv1d(x, weight, b, init, activation)
    torch.testing.assert_close(got.out, want.out, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.final_state, want.final_state)  # the carried window is copied, never computed


@pytest.mark.parametrize(
    ("rows", "width", "group", "gated"),
    [(1, 1024, 512, True), (512, 1024, 512, True), (7, 40, 8, True), (3, 24, 24, False)],
)
def test_norms_match_reference(rows: int, width: int, group: int, gated: bool) -> None:
    gen = torch.Generator().manual_seed(rows * width)
    projection = torch.randn(rows, width + 5, generator=gen)
    gate = projection[:, 2 : 2 + width] if gated else None  # rows lie apart, as a projection's split does
    x = torch.randn(rows, width, generator=gen) * 3
    weight = torch.randn(width, generator=gen)
    torch.testing.assert_close(
        native_norm.gated_rms_norm(x, gate, weight, 1e-5, group),
        norm.gated_rms_norm(x, gate, weight, 1e-5, group),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(
        native_norm.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-5
    )
    strided = torch.randn(2 * width, generator=gen)[::2]  # copied to a contiguous weight for the kernel
    torch.testing.assert_close(
        native_norm.rms_norm(x, strided, 1e-6), norm.rms_norm(x, strided, 1e-6), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        native_norm.gated_rms_norm(x, gate, strided, 1e-5, group),
        norm.gated_rms_norm(x, gate, strided, 1e-5, group),
        rtol=1e-5,
        atol=1e-5,
    )


def _scan_inputs(gen: torch.Generator, batch: int, length: int, heads: int, head_dim: int, groups: int, n: int):
    """x, dt, B, C [Bt, L, ...] as views into the rows of one projection's output, as the model has them."""
    widths = [heads * head_dim, groups * n, groups * n, heads]
    out = torch.randn(batch, length, sum(widths) + 3, generator=gen)
    x, b, c, dt, _ = out.split([*widths, 3], dim=-1)
    return (
        x.reshape(batch, length, heads, head_dim),
        dt,
        b.reshape(batch, length, groups, n),
        c.reshape(batch, length, groups, n),
    )


@pytest.mark.parametrize(
    ("batch", "length", "heads", "head_dim", "groups", "n", "chunk", "initial", "bias", "softplus", "limit"),
    [
        (1, 512, 16, 64, 2, 64, 128, False, True, True, (0.0, math.inf)),  # the medium preset's prefill
        (2, 100, 4, 8, 2, 16, 64, True, False, True, (0.0, math.inf)),  # two equal chunks of 50
        (1, 7, 6, 12, 3, 8, 64, True, True, False, (0.0, math.inf)),  # shorter than a chunk
        (1, 1, 4, 16, 1, 16, 64, True, True, True, (0.01, 0.5)),  # one token, dt clamped
        (1, 300, 8, 20, 2, 24, 32, True, True, True, (0.0, 0.1)),  # sizes off the vector width
    ],
)
def test_scan_matches_reference(
    batch, length, heads, head_dim, groups, n, chunk, initial, bias, softplus, limit
) -> None:
    gen = torch.Generator().manual_seed(length * 7 + heads)
    x, dt, B, C = _scan_inputs(gen, batch, length, heads, head_dim, groups, n)
    A = -torch.rand(heads, generator=gen) * 3
    D = torch.randn(heads, generator=gen)
    dt_bias = torch.randn(heads, generator=gen) if bias else None
    init = torch.randn(batch, heads, head_dim, n, generator=gen) if initial else None
    kept = None if init is None else init.clone()
    want = ssd.ssd_scan(x, dt, A, B, C, chunk, D, dt_bias, softplus, limit, init)
    got = native_ssd.ssd_scan(x, dt, A, B, C, chunk, D, dt_bias, softplus, limit, init)
    scale = want.y.abs().max()
    torch.testing.assert_close(got.y / scale, want.y / scale, rtol=0, atol=2e-6)
    torch.testing.assert_close(got.final_state, want.final_state, rtol=1e-5, atol=1e-5)
    if init is not None:
        assert torch.equal(init, kept)  # the initial state is read, never written


def test_scan_split_and_chained_equals_one_call() -> None:
    gen = torch.Generator().manual_seed(3)
    x, dt, B, C = _scan_inputs(gen, 1, 200, 4, 16, 2, 16)
    A = -torch.rand(4, generator=gen)
    whole = native_ssd.ssd_scan(x, dt, A, B, C, 64)
    first = native_ssd.ssd_scan(x[:, :77], dt[:, :77], A, B[:, :77], C[:, :77], 64)
    second = native_ssd.ssd_scan(x[:, 77:], dt[:, 77:], A, B[:, 77:], C[:, 77:], 64, initial_state=first.final_state)
    torch.testing.assert_close(torch.cat([first.y, second.y], dim=1), whole.y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(second.final_state, whole.final_state, rtol=1e-4, atol=1e-5)


def test_dispatch_takes_native_on_cpu_and_the_reference_when_told(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = native_ssd.selective_state_update
    monkeypatch.setattr(native_ssd, "selective_state_update", lambda *a: calls.append("native") or real(*a))
    gen = torch.Generator().manual_seed(0)
    x, dt, B, C = _projection_views(gen, 2, 4, 8, 2, 8)
    args = (torch.zeros(2, 4, 8, 8), x, dt, -torch.ones(4), B, C)
    for mode, expected in ((None, ["native"]), ("native", ["native"]), ("reference", [])):
        if mode is None:
            monkeypatch.delenv(dispatch.KERNELS_ENV, raising=False)
        else:
            monkeypatch.setenv(dispatch.KERNELS_ENV, mode)
        dispatch.kernels_mode.cache_clear()
        calls.clear()
        dispatch.selective_state_update(*args)
        assert calls == expected, mode
    dispatch.kernels_mode.cache_clear()
    # A dtype the native kernel does not take goes to the reference.
    monkeypatch.delenv(dispatch.KERNELS_ENV)
    calls.clear()
    dispatch.selective_state_update(*(t.double() for t in args))
    assert calls == []
    dispatch.kernels_mode.cache_clear()


def test_dispatch_checks_arguments_as_the_reference_does() -> None:
    with pytest.raises(ValueError, match=r"state must be \[Bt=2, H=4, P=8, N=8\]"):
        dispatch.selective_state_update(
            torch.zeros(2, 4, 8, 9), torch.zeros(2, 4, 8), torch.zeros(2, 4), -torch.ones(4),
            torch.zeros(2, 2, 8), torch.zeros(2, 2, 8),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"conv_state must be \[B=1, D=4, K-1=3\]"):
        dispatch.causal_conv1d_update(torch.zeros(1, 4), torch.zeros(1, 4, 2), torch.zeros(4, 4), None)
    with pytest.raises(ValueError, match=r"seq_lens must be in \[1, max_len=2\]"):
        dispatch.paged_attention_decode(
            torch.zeros(1, 2, 4), torch.zeros(8, 1, 4), torch.zeros(8, 1, 4), torch.zeros(1, 2, dtype=torch.int64),
            torch.tensor([3]), 1.0,
        )  # fmt: skip


def test_a_kernel_out_of_memory_raises_and_the_process_goes_on() -> None:
    """A kernel whose scratch memory cannot be had raises MemoryError and writes nothing; the next
    call works (driven in a subprocess whose address space is capped just above what it holds)."""
    import subprocess
    import sys

    script = """
import resource, torch
from himamba.kernels.native import attention
k = torch.randn(150_000, 4, 64)
q = torch.randn(4, 8, 64)
slots = torch.arange(150_000)
attention.paged_attention_prefill(q[:1], k, k, slots[:8], 7, 0.125)  # load the library first
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), resource.RLIM_INFINITY))
try:
    attention.paged_attention_prefill(q, k, k, slots, 150_000 - 4, 0.125)  # needs ~300 MB of scratch
except MemoryError as e:
    print("refused:", e)
out = attention.paged_attention_prefill(q, k, k, slots[:20], 16, 0.125)
print("then fine:", bool(torch.isfinite(out).all()))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "refused: paged_attention_prefill: out of memory" in done.stdout
    assert "then fine: True" in done.stdout


def test_the_worker_says_what_cpu_tensors_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dispatch.describe_cpu_kernels().startswith("native where one exists")
    assert build.native_build().detail in dispatch.describe_cpu_kernels()
    monkeypatch.setenv(dispatch.KERNELS_ENV, "reference")
    dispatch.kernels_mode.cache_clear()
    try:
        assert dispatch.describe_cpu_kernels() == "reference (HIMAMBA_KERNELS=reference)"
    finally:
        monkeypatch.delenv(dispatch.KERNELS_ENV)
        dispatch.kernels_mode.cache_clear()


def test_build_is_cached_and_a_failed_compiler_keeps_the_reference(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "a"))
    build.native_build.cache_clear()
    try:
        first = build.native_build()
        assert first.library is not None, first.detail
        built = list((tmp_path / "a").glob("*.so"))
        assert len(built) == 1 and built[0].name in first.detail
        stamp = built[0].stat().st_mtime_ns
        build.native_build.cache_clear()
        again = build.native_build()  # a second process: loads the file, compiles nothing
        assert again.detail == first.detail and built[0].stat().st_mtime_ns == stamp

        monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "b"))
        monkeypatch.setenv("CC", "false")  # a compiler that fails every time
        build.native_build.cache_clear()
        failed = build.native_build()
        assert failed.library is None and failed.detail.startswith("not built")
        assert not list((tmp_path / "b").glob("*"))  # no half-written library left behind
        monkeypatch.setenv(dispatch.KERNELS_ENV, "native")
        dispatch.kernels_mode.cache_clear()
        with pytest.raises(RuntimeError, match="HIMAMBA_KERNELS=native but the native kernels are not built"):
            dispatch.uses_native(torch.zeros(1))
        monkeypatch.delenv(dispatch.KERNELS_ENV)
        dispatch.kernels_mode.cache_clear()
        assert not dispatch.uses_native(torch.zeros(1))  # auto: the reference
        assert dispatch.describe_cpu_kernels().startswith("PyTorch reference (native kernels not built")
    finally:
        monkeypatch.undo()
        build.native_build.cache_clear()
        dispatch.kernels_mode.cache_clear()
