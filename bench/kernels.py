"""`himamba bench kernels`: each op's Triton twin against its PyTorch reference, on CUDA.

Per op, inputs of a serving-sized shape (Nemotron-H / Qwen3-Next-like dimensions, decode batch 64,
prefill 2048 tokens, 4096 tokens of context) in the chosen dtype; both implementations run on the
same tensors, alternating, timed with CUDA events after a warm-up; figures are medians. Each row
also gives the largest difference between the two outputs. The last line is one JSON object, also
written to --out.

Without a GPU it says so and exits 1: the twins' timings only mean something on one. (Under
TRITON_INTERPRET=1 it runs the same code on CPU at tiny sizes with --tiny, to test the bench
itself; those timings are the interpreter's and are labelled so.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from himamba.kernels.reference import attention, conv1d, delta_rule, moe, norm, selective_scan, ssd, state_rows

NO_GPU = (
    "himamba bench kernels needs a CUDA GPU: it times each op's Triton twin against its PyTorch reference "
    "on CUDA tensors, and this machine has none. (The twins are verified on CPU by the test suite, under "
    "Triton's interpreter, and compiled for sm_90 there; that says nothing about their speed.)"
)


# The ops timed, in order: every dispatched op but write_kv and scatter_state_rows (the same copies
# as gather_state_rows, the other way).
OPS = (
    "rms_norm", "gated_rms_norm", "causal_conv1d", "causal_conv1d_update", "ssd_scan", "selective_state_update",
    "paged_attention_prefill", "paged_attention_decode", "selective_scan", "selective_state_update_mamba1",
    "chunk_gated_delta_rule", "recurrent_gated_delta_rule_update", "moe_route", "moe_experts", "gather_state_rows",
)  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One op's timings (milliseconds, medians) and how far apart the two outputs are."""

    op: str
    shape: str
    reference_ms: float
    triton_ms: float
    speedup: float
    max_abs_diff: float


def _twin(family: str) -> Any:
    import importlib

    return importlib.import_module(f"himamba.kernels.triton.{family}")


Call = Callable[[bool], Any]


def _cases(device: torch.device, dtype: torch.dtype, tiny: bool) -> list[tuple[str, str, Call, Call]]:
    """(op, shape, reference call, twin call) per op. A call returns the op's output tensor; with
    True it first copies the state an in-place op updates (for comparing outputs, not for timing)."""

    def r(*shape: int, scale: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * scale).to(dt)

    f32 = torch.float32
    bsz, ctx, tokens = (3, 40, 24) if tiny else (64, 4096, 2048)
    heads, head_dim, groups, state = (4, 16, 2, 16) if tiny else (128, 64, 8, 128)
    hidden, conv_dim = (64, 96) if tiny else (4096, 128 * 64 + 2 * 8 * 128)
    q_heads, kv_heads, dh = (8, 2, 64) if tiny else (32, 8, 128)
    k_heads, v_heads, dk, dv = (2, 4, 16, 32) if tiny else (16, 32, 128, 128)
    experts, top_k, inter = (8, 2, 32) if tiny else (128, 8, 1024)
    out: list[tuple[str, str, Call, Call]] = []

    def add(op: str, shape: str, family: str, module: Any, args: Callable[[], tuple], pick=lambda o: o,
            mutates: int | None = None) -> None:  # fmt: skip
        def call(impl: Callable[[], Any]) -> Call:
            def run(fresh: bool) -> Any:
                a = list(args())
                if fresh and mutates is not None:
                    a[mutates] = a[mutates].clone()
                return pick(impl()(*a))

            return run

        out.append((op, shape, call(lambda: getattr(module, op)), call(lambda: getattr(_twin(family), op))))

    x2, w = r(tokens, hidden), r(hidden)
    add("rms_norm", f"[{tokens}, {hidden}]", "norm", norm, lambda: (x2, w, 1e-5))
    y2, z2, wy = r(tokens, heads * head_dim), r(tokens, heads * head_dim), r(heads * head_dim)
    add("gated_rms_norm", f"[{tokens}, {heads * head_dim}] / {groups} groups", "norm", norm,
        lambda: (y2, z2, wy, 1e-5, heads * head_dim // groups))  # fmt: skip
    xc, cw, cb, cs = r(1, tokens, conv_dim).transpose(1, 2), r(conv_dim, 4), r(conv_dim), r(1, conv_dim, 3)
    add("causal_conv1d", f"[1, {conv_dim}, {tokens}] K=4", "conv1d", conv1d, lambda: (xc, cw, cb, cs), lambda o: o.out)
    xd, sd = r(bsz, conv_dim), r(bsz, conv_dim, 3)
    add("causal_conv1d_update", f"[{bsz}, {conv_dim}] K=4", "conv1d", conv1d, lambda: (xd, sd, cw, cb), mutates=1)
    A, D, dtb = -torch.rand(heads, device=device) - 0.5, r(heads, dt=f32), r(heads, dt=f32)
    xs, dts = r(1, tokens, heads, head_dim), r(1, tokens, heads)
    Bs, Cs = r(1, tokens, groups, state), r(1, tokens, groups, state)
    add("ssd_scan", f"L={tokens} H={heads} P={head_dim} G={groups} N={state}", "ssd", ssd,
        lambda: (xs, dts, A, Bs, Cs, 256, D, dtb), lambda o: o.y)  # fmt: skip
    st = r(bsz, heads, head_dim, state, dt=f32, scale=0.1)
    xu, dtu, Bu, Cu = r(bsz, heads, head_dim), r(bsz, heads), r(bsz, groups, state), r(bsz, groups, state)
    add("selective_state_update", f"B={bsz} H={heads} P={head_dim} N={state}", "ssd", ssd,
        lambda: (st, xu, dtu, A, Bu, Cu, D, dtb), mutates=0)  # fmt: skip
    pool = ctx * bsz + 16
    kc, vc = r(pool, kv_heads, dh), r(pool, kv_heads, dh)
    seq_slots = torch.randperm(pool, device=device)[:ctx]
    qp = r(tokens if tokens < ctx else ctx // 2, q_heads, dh)
    prefix = ctx - qp.shape[0]
    add("paged_attention_prefill", f"T={qp.shape[0]} prefix={prefix} Hq/Hkv={q_heads}/{kv_heads} Dh={dh}",
        "attention", attention, lambda: (qp, kc, vc, seq_slots, prefix, dh**-0.5))  # fmt: skip
    table = torch.randperm(pool, device=device)[: bsz * ctx].view(bsz, ctx)
    lens = torch.randint(ctx // 2, ctx + 1, (bsz,), device=device)
    qd = r(bsz, q_heads, dh)
    add("paged_attention_decode", f"B={bsz} ctx<={ctx} Hq/Hkv={q_heads}/{kv_heads} Dh={dh}", "attention", attention,
        lambda: (qd, kc, vc, table, lens, dh**-0.5))  # fmt: skip
    channels = heads * head_dim // 2
    A1 = -torch.rand(channels, 16, device=device) - 0.5
    u1, d1, B1, C1 = r(1, tokens, channels), r(1, tokens, channels), r(1, tokens, 16), r(1, tokens, 16)
    add("selective_scan", f"L={tokens} D={channels} N=16", "selective_scan", selective_scan,
        lambda: (u1, d1, A1, B1, C1), lambda o: o.y)  # fmt: skip
    s1, x1, t1, b1, c1 = r(bsz, channels, 16, dt=f32), r(bsz, channels), r(bsz, channels), r(bsz, 16), r(bsz, 16)
    add("selective_state_update_mamba1", f"B={bsz} D={channels} N=16", "selective_scan", selective_scan,
        lambda: (s1, x1, t1, A1, b1, c1), mutates=0)  # fmt: skip
    qg, kg, vg = r(1, tokens, k_heads, dk), r(1, tokens, k_heads, dk), r(1, tokens, v_heads, dv)
    gg, bg = -torch.rand(1, tokens, v_heads, device=device), torch.rand(1, tokens, v_heads, device=device)
    add("chunk_gated_delta_rule", f"L={tokens} Hk/Hv={k_heads}/{v_heads} Dk={dk} Dv={dv}", "delta_rule", delta_rule,
        lambda: (qg, kg, vg, gg, bg), lambda o: o.out)  # fmt: skip
    sg = r(bsz, v_heads, dk, dv, dt=f32, scale=0.1)
    qs, ks, vs = r(bsz, k_heads, dk), r(bsz, k_heads, dk), r(bsz, v_heads, dv)
    gs, bs = -torch.rand(bsz, v_heads, device=device), torch.rand(bsz, v_heads, device=device)
    add("recurrent_gated_delta_rule_update", f"B={bsz} Hk/Hv={k_heads}/{v_heads} Dk={dk} Dv={dv}", "delta_rule",
        delta_rule, lambda: (qs, ks, vs, gs, bs, sg), mutates=5)  # fmt: skip
    logits = r(tokens, experts, dt=f32)
    add("moe_route", f"T={tokens} E={experts} top{top_k}", "moe", moe,
        lambda: (logits, top_k, "softmax", True), lambda o: o.weights)  # fmt: skip
    xm = r(tokens if tiny else 512, hidden)
    routing = moe.moe_route(r(xm.shape[0], experts, dt=f32), top_k, "softmax", True)
    gu, dn = r(experts, 2 * inter, hidden, scale=0.02), r(experts, hidden, inter, scale=0.02)
    add("moe_experts", f"T={xm.shape[0]} E={experts} top{top_k} H={hidden} I={inter}", "moe", moe,
        lambda: (xm, routing, gu, dn, "silu"))  # fmt: skip
    spool = r(512 if not tiny else 16, heads, head_dim, state, dt=f32)
    slots = torch.randperm(spool.shape[0], device=device)[:bsz]
    add("gather_state_rows", f"B={bsz} rows of [{heads}, {head_dim}, {state}]", "state_rows", state_rows,
        lambda: (spool, slots))  # fmt: skip
    assert tuple(op for op, *_ in out) == OPS
    return out


def _time(fn: Callable[[], Any], device: torch.device, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def run(device: torch.device, dtype: torch.dtype, tiny: bool, repeats: int, only: set[str] | None) -> list[Row]:
    rows = []
    torch.manual_seed(0)
    for op, shape, ref_fn, twin_fn in _cases(device, dtype, tiny):
        if only and op not in only:
            continue
        diff = (twin_fn(True).float() - ref_fn(True).float()).abs().max().item()
        for fn in (ref_fn, twin_fn):  # warm-up: the twin's first call compiles it
            fn(False)
        ref_times, twin_times = [], []
        for _ in range(repeats):  # alternate, so load from elsewhere hits both alike
            ref_times += _time(lambda fn=ref_fn: fn(False), device, 1)
            twin_times += _time(lambda fn=twin_fn: fn(False), device, 1)
        ref_ms, twin_ms = statistics.median(ref_times), statistics.median(twin_times)
        rows.append(Row(op, shape, round(ref_ms, 4), round(twin_ms, 4), round(ref_ms / twin_ms, 2), diff))
        print(f"{op:34s} {shape:48s} ref {ref_ms:9.3f} ms  triton {twin_ms:9.3f} ms  x{ref_ms / twin_ms:6.2f}  "
              f"max|diff| {diff:.2e}", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="himamba bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="input dtype")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per op and implementation")
    p.add_argument("--ops", default="", help="comma-separated op names to run (default: all)")
    p.add_argument("--out", type=Path, default=Path("bench_kernels.json"), help="where to write the JSON")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (to test the bench under TRITON_INTERPRET=1)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `himamba bench kernels`; returns the exit status (1 without a GPU)."""
    opts = parse_args(list(sys.argv[1:] if argv is None else argv))
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    if torch.cuda.is_available() and not interpreter:
        device = torch.device("cuda")
        machine = torch.cuda.get_device_name(device)
    elif interpreter and opts.tiny:
        device = torch.device("cpu")
        machine = f"CPU ({platform.processor() or platform.machine()}) under TRITON_INTERPRET=1: not a GPU timing"
    else:
        print(NO_GPU, file=sys.stderr)
        return 1
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[opts.dtype]
    if device.type == "cpu" and dtype == torch.bfloat16:
        dtype = torch.float32  # the interpreter cannot compute in bfloat16
    print(f"himamba bench kernels on {machine}, {dtype}, {opts.repeats} repeats (medians)", file=sys.stderr)
    only = {o for o in opts.ops.split(",") if o} or None
    if only and not only <= set(OPS):
        print(f"unknown op(s) {sorted(only - set(OPS))}; known: {', '.join(OPS)}", file=sys.stderr)
        return 2
    rows = run(device, dtype, opts.tiny, opts.repeats, only)
    summary = {"machine": machine, "dtype": str(dtype), "tiny": opts.tiny, "rows": [asdict(r) for r in rows]}
    opts.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
