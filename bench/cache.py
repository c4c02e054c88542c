"""`himamba bench cache`: drive the radix tree and allocators alone with a synthetic multi-turn trace.

No model and no processes: each request does what the scheduler and the cache controller do with
the tree (match, lock, load back, allocate with eviction, insert, unlock), and every transfer is
acknowledged at once. Prints throughput, per-operation latency, the cached-token ratio per tier
against the ideal ratio, peak traced memory, and one JSON object as the last line. With `storage`
in `--tiers` it also measures the storage backend's read/write MB/s on a scratch store, beside
this machine's sequential disk and memcpy bandwidth. Writes <out>/cache.json (the machine, the
workload and everything printed) and <out>/cache.png (needs matplotlib: `pip install 'himamba[bench]'`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from himamba.bench.cache_report import Transcript, workload, workload_line, write_report
from himamba.bench.machine_info import describe_machine
from himamba.bench.progress import Progress
from himamba.bench.storage_bandwidth import (
    disk_probe,
    machine_bandwidth,
    measure_storage_bandwidth,
)
from himamba.services.cache.allocator import PageAllocator, SlotAllocator
from himamba.services.cache.eviction import EVICTION_POLICIES
from himamba.services.cache.tree.orders import BackupOp
from himamba.services.cache.tree.radix_tree import WRITE_POLICIES, RadixTree
from himamba.services.cache.storage.factory import open_backend
from himamba.services.cache.storage.file import FileBackend
from himamba.services.cache.storage.local_stores import start_local_store

VOCAB_SIZE = 32000


@dataclass(frozen=True)
class Request:
    """One turn of one client: `prompt` is sent, `full` = prompt + generated tokens gets cached."""

    client: int
    turn: int
    prompt: tuple[int, ...]
    full: tuple[int, ...]
    ideal_cached_len: int  # page-aligned context repeated from the client's previous turn


@dataclass
class Trace:
    """Requests in arrival order and the number of distinct prefix tokens they contain."""

    requests: list[Request]
    unique_tokens: int


@dataclass
class Stats:
    """Counters and per-operation timings (ns) of one run."""

    prompt_tokens: int = 0
    ideal_tokens: int = 0
    device_tokens: int = 0
    host_tokens: int = 0
    load_failures: int = 0
    skipped_inserts: int = 0
    stateless_inserts: int = 0
    num_backups: int = 0
    wall_s: float = 0.0
    match_ns: list[int] = field(default_factory=list)
    insert_ns: list[int] = field(default_factory=list)
    evict_ns: list[int] = field(default_factory=list)
    backup_ns: list[int] = field(default_factory=list)
    load_ns: list[int] = field(default_factory=list)


def build_trace(clients: int, turns: int, first: int, each: int, gen: int, page_size: int, seed: int) -> Trace:
    """Round r of client c: the previous prompt + `gen` generated + `each` new tokens (round 1: `first`).

    Requests are interleaved round-robin: A1, B1, ..., A2, B2, ...
    """
    rng = random.Random(seed)
    prompts = [tuple(rng.randrange(VOCAB_SIZE) for _ in range(first)) for _ in range(clients)]
    prev_full: list[tuple[int, ...]] = [()] * clients
    requests: list[Request] = []
    unique = 0
    for turn in range(turns):
        for c in range(clients):
            if turn:
                prompts[c] = prev_full[c] + tuple(rng.randrange(VOCAB_SIZE) for _ in range(each))
            prompt = prompts[c]
            full = prompt + tuple(rng.randrange(VOCAB_SIZE) for _ in range(gen))
            ideal = min(len(prev_full[c]), len(prompt) - 1) // page_size * page_size
            requests.append(Request(c, turn, prompt, full, ideal))
            prev_full[c] = full
    for c in range(clients):
        unique += len(prev_full[c])
    return Trace(requests, unique)


@dataclass
class Pools:
    """The four allocators of one run."""

    device_kv: PageAllocator
    device_state: SlotAllocator
    host_kv: PageAllocator | None
    host_state: SlotAllocator | None


def make_pools(args: argparse.Namespace, unique_tokens: int) -> Pools:
    """Device KV sized as a fraction of the trace's unique tokens; host pools as ratios of the device ones."""
    device_pages = max(1, round(args.kv_frac * unique_tokens / args.page_size))
    host_kv = host_state = None
    if args.host_ratio > 0:
        host_kv = PageAllocator(max(1, round(args.host_ratio * device_pages)))
        host_state = SlotAllocator(max(1, round(args.host_ratio * args.mamba_slots)))
    return Pools(PageAllocator(device_pages), SlotAllocator(args.mamba_slots), host_kv, host_state)


def _timed_backup(tree: RadixTree, stats: Stats) -> Callable[..., BackupOp | None]:
    # Wraps the instance attribute, so backups the tree issues internally are timed too.
    inner = tree.backup

    def backup(node):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter_ns()
        op = inner(node)
        stats.backup_ns.append(time.perf_counter_ns() - t0)
        return op

    return backup


def run(trace: Trace, args: argparse.Namespace, *, timed: bool) -> tuple[Stats, RadixTree]:
    """Serve the whole trace against a fresh tree; returns the stats and the final tree."""
    pools = make_pools(args, trace.unique_tokens)
    tree = RadixTree(
        args.page_size,
        pools.device_kv,
        pools.device_state,
        pools.host_kv,
        pools.host_state,
        write_policy=args.write_policy,
        eviction_policy=args.policy,
        seed=args.seed,
    )
    stats = Stats()
    if timed:
        tree.backup = _timed_backup(tree, stats)  # type: ignore[method-assign]
    ps = args.page_size
    kv = pools.device_kv
    st = pools.device_state
    now = time.perf_counter_ns

    def ack(ops: list[BackupOp]) -> None:
        stats.num_backups += len(ops)
        for op in ops:
            tree.backup_done(op)

    start = time.perf_counter()
    for req in trace.requests:
        prompt = req.prompt
        stats.prompt_tokens += len(prompt)
        stats.ideal_tokens += req.ideal_cached_len
        t0 = now()
        m = tree.match_prefix(prompt[:-1])
        stats.match_ns.append(now() - t0)
        ack(m.backups)
        receipt = tree.lock(m.node)
        cached = m.cached_len
        loaded = 0
        prefix_pages = m.device_pages
        if m.host_len or m.state_tier == "host":
            t0 = now()
            op = tree.load_back(m.node)
            stats.load_ns.append(now() - t0)
            if op is None:
                # Fall back to what is usable without a load: the deepest device node with a device state.
                stats.load_failures += 1
                cached = m.device_cached_len
                prefix_pages = m.device_pages[: cached // ps]
                old, receipt = receipt, tree.lock(m.device_node)
                tree.unlock(old)
            else:
                ack(op.backups)
                tree.load_back_done(op)
                old, receipt = receipt, tree.lock(m.node)
                tree.unlock(old)
                prefix_pages = prefix_pages + op.device_pages
                loaded = m.host_len
        stats.host_tokens += loaded
        stats.device_tokens += cached - loaded

        n_full = len(req.full) // ps
        need = n_full - cached // ps
        pages = kv.alloc(need)
        if pages is None:
            t0 = now()
            res = tree.evict(need - kv.num_free)
            stats.evict_ns.append(now() - t0)
            ack(res.backups)
            pages = kv.alloc(need)
        if pages is None:
            stats.skipped_inserts += 1
            tree.unlock(receipt)
            continue
        slots = st.alloc(1)
        if slots is None:
            t0 = now()
            res = tree.evict_state(1)
            stats.evict_ns.append(now() - t0)
            ack(res.backups)
            slots = st.alloc(1)
        if slots is None:
            stats.stateless_inserts += 1
        t0 = now()
        ins = tree.insert(req.full[: n_full * ps], prefix_pages + pages, slots[0] if slots else None, cached)
        stats.insert_ns.append(now() - t0)
        ack(ins.backups)
        tree.unlock(receipt)
    stats.wall_s = time.perf_counter() - start
    return stats, tree


def _us(ns: list[int]) -> tuple[float, float]:
    if not ns:
        return 0.0, 0.0
    return statistics.median(ns) / 1000, statistics.fmean(ns) / 1000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The bench's command line; ArgumentParser.error (exit 2) on a bad value."""
    p = argparse.ArgumentParser(prog="himamba bench cache", description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--first", type=int, default=512, help="tokens of a client's first prompt")
    p.add_argument("--each", type=int, default=64, help="new user tokens per later turn")
    p.add_argument("--gen", type=int, default=32, help="generated tokens per turn")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-frac", type=float, default=0.25, help="device KV capacity / unique tokens of the trace")
    p.add_argument("--mamba-slots", type=int, default=None, help="device state slots (default 2*clients+8)")
    p.add_argument("--host-ratio", type=float, default=0.0, help="host pool = ratio x device pool; 0 = no host tier")
    p.add_argument("--policy", choices=EVICTION_POLICIES, default="lru")
    p.add_argument("--write-policy", choices=WRITE_POLICIES, default="write_through")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="timed passes over the trace; requests/s is their median")
    p.add_argument("--no-memory", action="store_true", help="skip the traced-memory pass")
    p.add_argument(
        "--tiers", default="", help="comma list of device,host,storage (default: device, plus host with --host-ratio)"
    )
    p.add_argument("--backend", choices=["file", "mooncake", "redis"], default="file", help="storage backend")
    p.add_argument("--storage-dir", default="", help="file backend scratch dir (default: a temp dir)")
    p.add_argument("--storage-url", default="", help="redis:// URL or the Mooncake master's host:port")
    p.add_argument("--storage-pages", type=int, default=512, help="pages written then read by the probe")
    p.add_argument("--storage-page-kib", type=int, default=64, help="bytes per stored page, KiB")
    p.add_argument(
        "--storage-fsync", action="store_true", help="file backend and disk probe fsync each batch (default: off, as served)"
    )
    p.add_argument("--out", default="himamba-bench-cache", help="folder for cache.json and cache.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()] or ["device"] + (["host"] if args.host_ratio else [])
    if not tiers or any(t not in ("device", "host", "storage") for t in tiers) or "device" not in tiers:
        p.error("--tiers must list device and optionally host, storage")
    args.tiers = tiers
    if "host" in tiers and args.host_ratio == 0:
        args.host_ratio = 2.0
    if args.storage_pages < 1 or args.storage_page_kib < 1:
        p.error("--storage-pages and --storage-page-kib must be >= 1")
    for name in ("clients", "turns", "first", "page_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("each", "gen"):
        if getattr(args, name) < 0:
            p.error(f"--{name} must be >= 0")
    if args.kv_frac <= 0 or args.host_ratio < 0:
        p.error("--kv-frac must be > 0 and --host-ratio >= 0")
    if args.mamba_slots is None:
        args.mamba_slots = 2 * args.clients + 8
    if args.mamba_slots < 1:
        p.error("--mamba-slots must be >= 1")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args


def storage_bandwidth(args: argparse.Namespace) -> dict[str, float | str]:
    """The backend's write/read MB/s on a scratch store, and the machine's disk and memcpy. A
    remote backend without `--storage-url` gets a store started here on 127.0.0.1 (redis-server,
    or mooncake_master + mooncake_client), stopped by PID afterwards."""
    with tempfile.TemporaryDirectory(prefix="himamba-bench-storage-") as tmp:
        directory = Path(args.storage_dir) if args.storage_dir else Path(tmp)
        url, metadata, store = args.storage_url, "", None
        if args.backend != "file" and not url:
            store = start_local_store(args.backend, Path(tmp) / "store")
            url, metadata = store.address, store.metadata
        got: dict[str, float | str]
        try:
            page_bytes = args.storage_page_kib * 1024
            if args.backend == "file":
                got = _file_vs_probe(directory, page_bytes, args.storage_pages, args.storage_fsync)
            else:
                backend = open_backend(
                    args.backend, os.urandom(32), directory=directory, url=url, mooncake_metadata_server=metadata
                )
                assert backend is not None
                try:
                    got = dict(measure_storage_bandwidth(backend, page_bytes, args.storage_pages))
                finally:
                    backend.close()
        finally:
            if store is not None:
                store.stop()
        got.update(machine_bandwidth(directory))
    got["backend"] = args.backend
    got["store"] = "local (started by the bench)" if store is not None else (url or "default")
    return got


_PROBE_ROUNDS = 7


def _file_vs_probe(directory: Path, page_bytes: int, n_pages: int, fsync: bool) -> dict[str, float | str]:
    """The file backend next to a disk probe on the probe's own terms: the same directory, page
    size and fsync policy, and cold reads for both. Alternating rounds (backend, then probe): the
    MB/s shown are the best of each, the ratios the median over rounds of each round's pair (two
    runs seconds apart share the machine's load; two maxima from different moments need not), and
    the CPU ratios compare the CPU seconds each spent on the same bytes (load barely moves them;
    with fsync off the probe's "disk" is the page cache, so CPU is what bounds both)."""
    rounds: list[dict[str, float]] = []
    for _ in range(_PROBE_ROUNDS):
        with tempfile.TemporaryDirectory(dir=directory, prefix="himamba-bench-file-") as tmp:
            backend = FileBackend(os.urandom(32), Path(tmp), fsync=fsync)
            try:
                r = measure_storage_bandwidth(backend, page_bytes, n_pages, cold=backend.dir)
            finally:
                backend.close()
        r.update(disk_probe(directory, page_bytes, n_pages, fsync=fsync))
        rounds.append(r)
    # Best of each: the highest MB/s, the fewest CPU seconds.
    got: dict[str, float | str] = {k: (min if k.endswith("_cpu_s") else max)(r[k] for r in rounds) for k in rounds[0]}
    for op in ("write", "read"):
        got[f"{op}_vs_probe"] = statistics.median(r[f"{op}_mb_s"] / max(r[f"probe_{op}_mb_s"], 1e-9) for r in rounds)
        got[f"{op}_vs_probe_best"] = float(got[f"{op}_mb_s"]) / max(float(got[f"probe_{op}_mb_s"]), 1e-9)
        got[f"{op}_cpu_vs_probe"] = statistics.median(r[f"probe_{op}_cpu_s"] / max(r[f"{op}_cpu_s"], 1e-9) for r in rounds)
    got["fsync"] = "on" if fsync else "off"
    got["rounds"] = float(_PROBE_ROUNDS)
    return got


def main(argv: list[str] | None = None) -> int:
    """Entry point of `himamba bench cache`; returns the exit status."""
    args = parse_args(argv)
    # No torch here: the line still states cores and torch's threads, as every bench figure does.
    machine = describe_machine(0, "cpu")
    work = workload(args)
    out = Transcript()
    out(machine.line())
    out(workload_line(work))
    trace = build_trace(args.clients, args.turns, args.first, args.each, args.gen, args.page_size, args.seed)
    steps = args.repeat + (0 if args.no_memory else 1) + ("storage" in args.tiers)
    progress = Progress(steps, "bench cache", enabled=not args.no_progress, unit="pass", units="passes")
    # Each pass starts from an empty cache and is identical; timings of all passes are pooled and
    # requests/s is the median pass (timings on a shared 2-core machine vary several-fold).
    passes = []
    for _ in range(args.repeat):
        passes.append(run(trace, args, timed=True))
        progress.update()
    for _, tree in passes:
        tree.check_invariants()
    stats = passes[0][0]
    for extra, _ in passes[1:]:
        for name in ("match_ns", "insert_ns", "evict_ns", "backup_ns", "load_ns"):
            getattr(stats, name).extend(getattr(extra, name))
    walls = sorted(s.wall_s for s, _ in passes)
    peak_mib = None
    if not args.no_memory:
        tracemalloc.start()
        run(trace, args, timed=False)
        peak_mib = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        progress.update()
    bw = storage_bandwidth(args) if "storage" in args.tiers else None
    progress.close()

    n = len(trace.requests)
    rps = n / statistics.median(walls)
    best_rps = n / walls[0]
    total = max(1, stats.prompt_tokens)
    device_ratio = stats.device_tokens / total
    host_ratio = stats.host_tokens / total
    ideal_ratio = stats.ideal_tokens / total
    pools = make_pools(args, trace.unique_tokens)
    out(
        f"trace: {args.clients} clients x {args.turns} turns, {n} requests, {stats.prompt_tokens} prompt tokens, "
        f"{trace.unique_tokens} unique tokens, page {args.page_size}"
    )
    out(
        f"pools: device {pools.device_kv.capacity} pages / {args.mamba_slots} states, host "
        + (f"{pools.host_kv.capacity} pages / {pools.host_state.capacity} states" if pools.host_kv and pools.host_state else "none")
        + f"; policy {args.policy}, {args.write_policy}"
    )
    out(
        f"throughput: {rps:,.0f} requests/s (median of {len(walls)} passes, best {best_rps:,.0f}; "
        f"{statistics.median(walls) * 1000:.1f} ms per pass)"
    )
    for name, ns in (
        ("match", stats.match_ns),
        ("insert", stats.insert_ns),
        ("evict", stats.evict_ns),
        ("backup", stats.backup_ns),
        ("load-back", stats.load_ns),
    ):
        med, mean = _us(ns)
        out(f"  {name:<9} n={len(ns):>6}  median {med:8.2f} us  mean {mean:8.2f} us")
    out(
        f"cached ratio: {device_ratio + host_ratio:.4f} (device {device_ratio:.4f}, host {host_ratio:.4f}) "
        f"vs ideal {ideal_ratio:.4f}; load-back failures {stats.load_failures}, skipped inserts "
        f"{stats.skipped_inserts}, inserts without a state {stats.stateless_inserts}, backups {stats.num_backups}"
    )
    if peak_mib is not None:
        out(f"peak traced memory: {peak_mib:.1f} MiB")
    if bw is not None:
        out(
            f"storage ({bw['backend']}, {args.storage_pages} pages x {args.storage_page_kib} KiB): "
            f"write {bw['write_mb_s']:,.0f} MB/s, read {bw['read_mb_s']:,.0f} MB/s; machine: disk write+fsync "
            f"{bw['disk_write_fsync_mb_s']:,.0f} MB/s, disk read {bw['disk_read_mb_s']:,.0f} MB/s, "
            f"memcpy {bw['memcpy_gb_s']:.1f} GB/s, {bw['file_creates_per_s']:,.0f} file creates/s"
        )
        if "probe_write_mb_s" in bw:
            out(
                f"storage vs a disk probe (same directory, {args.storage_page_kib} KiB pages, fsync {bw['fsync']}, "
                f"cold reads, {bw['rounds']:.0f} alternating rounds; MB/s best of each): write "
                f"{bw['write_mb_s']:,.0f} vs {bw['probe_write_mb_s']:,.0f} MB/s (best/best "
                f"{bw['write_vs_probe_best']:.0%}, median of the rounds' pairs {bw['write_vs_probe']:.0%}, per CPU "
                f"second {bw['write_cpu_vs_probe']:.0%}), read {bw['read_mb_s']:,.0f} vs {bw['probe_read_mb_s']:,.0f} "
                f"MB/s (best/best {bw['read_vs_probe_best']:.0%}, pairs {bw['read_vs_probe']:.0%}, per CPU second "
                f"{bw['read_cpu_vs_probe']:.0%})"
            )
    result = {
        "requests": n,
        "requests_per_s": round(rps, 1),
        "requests_per_s_best": round(best_rps, 1),
        "cached_ratio": round(device_ratio + host_ratio, 4),
        "ideal_ratio": round(ideal_ratio, 4),
        "device_ratio": round(device_ratio, 4),
        "host_ratio": round(host_ratio, 4),
        "policy": args.policy,
        "write_policy": args.write_policy,
        "kv_frac": args.kv_frac,
        "mamba_slots": args.mamba_slots,
        "host_ratio_arg": args.host_ratio,
        "load_failures": stats.load_failures,
        "skipped_inserts": stats.skipped_inserts,
        "peak_traced_mib": None if peak_mib is None else round(peak_mib, 2),
        "tiers": ",".join(args.tiers),
    }
    if bw is not None:
        for k, v in bw.items():
            result[f"storage_{k}"] = round(v, 2) if isinstance(v, float) else v
    for name, ns in (
        ("match", stats.match_ns),
        ("insert", stats.insert_ns),
        ("evict", stats.evict_ns),
        ("backup", stats.backup_ns),
        ("load_back", stats.load_ns),
    ):
        med, mean = _us(ns)
        result[f"{name}_us_median"] = round(med, 2)
        result[f"{name}_us_mean"] = round(mean, 2)
    pass_rps = [n / pass_stats.wall_s for pass_stats, _ in passes]
    written = write_report(Path(args.out), machine, work, out.lines, result, pass_rps)
    if written.png_path is None:
        print(f"note: {written.plot.note}")
    print(f"wrote {written.json_path}" + (f" and {written.png_path}" if written.png_path else ""))
    print(json.dumps(result))
    return 0
