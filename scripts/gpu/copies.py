"""The GPU check's copy step: host<->device GB/s of a KV page batch and a state batch at the 8B
shape, from pageable memory (what host_transfer.py does today), pinned memory, and a shared-memory
segment registered with CUDA (cudaHostRegister, how the host pools would be pinned; gVisor may refuse
it). Also how large /dev/shm is (the host pools live there).

    python -P scripts/gpu/copies.py --out FIGURES.json [--rehearse]"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import torch

# Nemotron-H-8B: a KV page of 16 tokens over 4 attention layers (K and V, 8 heads x 128, bf16) and
# one sequence's Mamba state over 24 layers (SSM 128 x 64 x 128 fp32, conv 10240 x 3 bf16).
KV_PAGE_BYTES = 16 * 4 * 2 * 8 * 128 * 2
STATE_BYTES = 24 * (128 * 64 * 128 * 4 + 10240 * 3 * 2)


def progress(what: str) -> None:
    print(f"copies: {what}", file=sys.stderr, flush=True)


def rate(fn, nbytes: int, cuda: bool, repeats: int = 5) -> float:
    """Median GB/s of `fn()` moving `nbytes`."""
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / sorted(times)[len(times) // 2] / 1e9


def register(t: torch.Tensor) -> str:
    """cudaHostRegister `t`'s memory; '' on success, else the error."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    return "" if int(err) == 0 else f"cudaHostRegister returned {err}"


def measure(nbytes: int, cuda: bool) -> dict:
    device = torch.device("cuda" if cuda else "cpu")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out: dict = {"bytes": nbytes}
    pageable = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    out["pageable_h2d_GBps"] = rate(lambda: dev.copy_(pageable), nbytes, cuda)
    out["pageable_d2h_GBps"] = rate(lambda: pageable.copy_(dev), nbytes, cuda)
    if not cuda:
        out["pinned"] = out["registered_shm"] = "SKIP (no CUDA)"
        return out
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out["pinned_h2d_GBps"] = rate(lambda: dev.copy_(pinned, non_blocking=True), nbytes, cuda)
    out["pinned_d2h_GBps"] = rate(lambda: pinned.copy_(dev, non_blocking=True), nbytes, cuda)
    shm = shared_memory.SharedMemory(create=True, size=nbytes)
    try:
        host = torch.frombuffer(shm.buf, dtype=torch.uint8)
        host.fill_(1)
        err = register(host)
        if err:
            out["registered_shm"] = err
        else:
            out["registered_h2d_GBps"] = rate(lambda: dev.copy_(host, non_blocking=True), nbytes, cuda)
            out["registered_d2h_GBps"] = rate(lambda: host.copy_(dev, non_blocking=True), nbytes, cuda)
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
        del host
    finally:
        shm.close()
        shm.unlink()
    return out


def host_transfer(cuda: bool, rehearse: bool) -> dict:
    """The worker's own copy orders (services/worker/host_transfer.py) at the 8B shape: 128 scattered
    KV pages and 8 state slots each way, packed runs (pinned host pools) against pageable copies."""
    from himamba.common.messages import Transfer
    from himamba.services.worker.host_transfer import HostTransfer, host_layout
    from himamba.services.worker.pools import KVPool, KVSpec, StateComponent, StatePool, StateSpec

    device = torch.device("cuda" if cuda else "cpu")
    pages, slots = (8, 2) if rehearse else (128, 8)
    layers = 1 if rehearse else 24
    kv = KVPool(KVSpec(1 if rehearse else 4, 8, 128, torch.bfloat16), 2 * pages, 16, device)
    comps = (StateComponent("conv", (10240, 3), torch.bfloat16), StateComponent("ssm", (128, 64, 128), torch.float32))
    state = StatePool(StateSpec(tuple(comps for _ in range(layers))), 2 * slots, device)
    gen = torch.Generator().manual_seed(0)
    dev_pages = torch.randperm(2 * pages, generator=gen)[:pages].tolist()
    host_pages = torch.randperm(2 * pages, generator=gen)[:pages].tolist()  # scattered: many runs
    dev_slots, host_slots = list(range(slots)), list(range(slots))
    out: dict = {"pages": pages, "slots": slots}
    nbytes = pages * kv.spec.bytes_per_token() * 16 + slots * state.spec.bytes_per_slot()
    for packed in (False, True):
        t = HostTransfer(kv, state, host_layout(kv, state, 2 * pages, 2 * slots), device, packed=packed)
        try:
            name = "packed" if packed else "pageable"
            if packed and cuda and t.pinned:
                out[name] = t.pinned
                continue
            d2h = Transfer(1, "d2h", dev_pages, host_pages, dev_slots, host_slots)
            h2d = Transfer(2, "h2d", host_pages, dev_pages, host_slots, dev_slots)
            out[f"{name}_d2h_GBps"] = rate(lambda: t.run(d2h), nbytes, cuda)
            out[f"{name}_h2d_GBps"] = rate(lambda: t.run(h2d), nbytes, cuda)
        finally:
            t.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--rehearse", action="store_true")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.rehearse
    shm = os.statvfs("/dev/shm")
    figures: dict = {"dev_shm_bytes": shm.f_blocks * shm.f_frsize, "dev_shm_free_bytes": shm.f_bavail * shm.f_frsize}
    pages, states = (8, 1) if a.rehearse else (128, 8)
    for name, nbytes in (("kv_pages", pages * KV_PAGE_BYTES), ("states", states * STATE_BYTES)):
        figures[name] = measure(nbytes, cuda)
        progress(f"{name} ({pages if name == 'kv_pages' else states}): {json.dumps(figures[name])}")
    figures["host_transfer"] = host_transfer(cuda, a.rehearse)
    progress(f"host_transfer: {json.dumps(figures['host_transfer'])}")
    a.out.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
