"""The GPU check's throughput step: an 8B-shaped Nemotron-H (Nemotron-H-8B's layer pattern and
sizes, bf16) with random weights generated on the device, in process (no 16 GB checkpoint written).

Decode tok/s at each batch (context `--context`), eager and, on CUDA, replayed from a CUDA graph
(the server's DecodeGraphs, input copies included); prefill tok/s of one prompt at each length. Each figure stands beside
its roofline: decode by the bytes a step must move (weights, KV, state read and written) over the
measured device copy bandwidth; prefill by its FLOPs over the measured bf16 matmul rate.

    python -P scripts/gpu/throughput.py --out FIGURES.json [--rehearse]

`--rehearse` runs the same logic on the CPU at a small shape, float32, graphs skipped.
Progress goes to stderr, one line per measurement (the check reports the last one on a timeout)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from himamba.bench.forward import model_cost
from himamba.services.modelgen.hf_configs import nemotron_h_config
from himamba.services.worker.decode_graphs import DecodeGraphs, Scratch
from himamba.services.worker.forward_batch import ForwardBatch
from himamba.services.worker.models.hf_config import read_config_json
from himamba.services.worker.models.registry import architecture_of, model_class
from himamba.services.worker.pools import KVPool, StatePool

# Nemotron-H-8B: 52 layers (24 Mamba2, 24 MLP, 4 attention), as its config.json's hybrid pattern.
PATTERN_8B = "M-M-M-M*-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-"
SHAPE_8B = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 21504,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "chunk_size": 128,
    "vocab_size": 131072,
    "max_position_embeddings": 16384,
}
KINDS = {"M": "mamba", "-": "mlp", "*": "attention"}
PAGE = 16


def progress(what: str) -> None:
    print(f"throughput: {what}", file=sys.stderr, flush=True)


def build(rehearse: bool, device: torch.device, dtype: torch.dtype):
    """The model with random weights drawn on `device` (N(0, 0.02); norms and D near 1, A_log near 0)."""
    if rehearse:
        cfg = nemotron_h_config("medium", 4096)
    else:
        cfg = nemotron_h_config("medium", SHAPE_8B["vocab_size"])
        cfg.update(SHAPE_8B, layers_block_type=[KINDS[c] for c in PATTERN_8B])
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        raw = read_config_json(Path(tmp))
    model = model_class(architecture_of(raw)).from_hf_config(raw, device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".D")):
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.uniform_(0.0, 1.0, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs (after one warm-up)."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def machine_rates(device: torch.device, dtype: torch.dtype, rehearse: bool) -> dict:
    """Measured copy bandwidth (bytes read + written per second) and matmul FLOP/s."""
    n = (64 if rehearse else 2048) << 20
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_s = timed(lambda: b.copy_(a), device, 5)
    size = 512 if rehearse else 8192
    x = torch.randn(size, size, device=device, dtype=dtype)
    y = torch.randn(size, size, device=device, dtype=dtype)
    mm_s = timed(lambda: x @ y, device, 5)
    return {"copy_bytes_per_s": 2 * n / copy_s, "matmul_flop_per_s": 2 * size**3 / mm_s}


class Decoder:
    """`batch` sequences of `context` tokens in the pools, decoded one token per step from static
    input tensors (updated in place on the device, so a CUDA graph can replay the forward)."""

    def __init__(self, model, batch: int, context: int, steps: int, device: torch.device) -> None:
        self.model, self.device, self.batch = model, device, batch
        max_len = context + steps + 2
        pages_per_seq = -(-max_len // PAGE)
        self.kv = KVPool(model.kv_spec(), batch * pages_per_seq + 1, PAGE, device)
        self.state = StatePool(model.state_spec(), batch + 1, device)
        # Shuffled pages: a long-running server's free list is never one consecutive run.
        pages = torch.randperm(batch * pages_per_seq, generator=torch.Generator().manual_seed(0)) + 1
        pages = pages.view(batch, pages_per_seq).to(device)
        offsets = torch.arange(pages_per_seq * PAGE, device=device)
        self.table = (pages.repeat_interleave(PAGE, dim=1) * PAGE + offsets % PAGE)[:, :max_len].contiguous()
        self.rows = torch.arange(batch, device=device)
        self.state_slots = torch.arange(1, batch + 1, device=device)
        self.context = context
        self._prefill(context)
        self.seq_lens = torch.full((batch,), context + 1, dtype=torch.int64, device=device)
        self.positions = torch.full((batch,), context, dtype=torch.int64, device=device)
        self.input_ids = torch.ones(batch, dtype=torch.int64, device=device)
        self.write_slots = self.table[self.rows, self.positions].clone()
        self.fb = ForwardBatch(
            mode="decode",
            input_ids=self.input_ids,
            positions=self.positions,
            new_lens=[1] * batch,
            prefix_lens=[context] * batch,
            write_slots=self.write_slots,
            slot_table=self.table,
            seq_lens=self.seq_lens,
            state_slots=self.state_slots,
        )

    def _prefill(self, context: int) -> None:
        group = max(1, 16384 // context)
        for start in range(0, self.batch, group):
            seqs = range(start, min(self.batch, start + group))
            fb = ForwardBatch(
                mode="prefill",
                input_ids=torch.randint(1, 1000, (len(seqs) * context,), device=self.device),
                positions=torch.arange(context, device=self.device).repeat(len(seqs)),
                new_lens=[context] * len(seqs),
                prefix_lens=[0] * len(seqs),
                write_slots=self.table[list(seqs), :context].reshape(-1),
                seq_slots=[self.table[i, :context] for i in seqs],
                state_slots=self.state_slots[list(seqs)],
                captures=[[] for _ in seqs],
            )
            with torch.inference_mode():
                self.model.forward(fb, self.kv, self.state)

    def forward(self) -> torch.Tensor:
        return self.model.forward(self.fb, self.kv, self.state)

    def advance(self, logits: torch.Tensor) -> None:
        """The next step's inputs, on the device: no host sync."""
        self.input_ids.copy_(logits.argmax(-1))
        self.positions.add_(1)
        self.seq_lens.add_(1)
        self.write_slots.copy_(self.table[self.rows, self.positions])


def decode(model, batch: int, context: int, steps: int, device: torch.device, graphs: bool, compare: bool) -> dict:
    d = Decoder(model, batch, context, 2 * steps + 8, device)
    out: dict = {}
    with torch.inference_mode():
        for _ in range(3):
            d.advance(d.forward())
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            d.advance(d.forward())
        sync(device)
        eager = (time.perf_counter() - t0) / steps
        out["eager_ms_per_step"] = eager * 1e3
        out["eager_tok_per_s"] = batch / eager
        # Host time to enqueue one step (CPU-side launch cost): near the step time means launch-bound.
        t0 = time.perf_counter()
        d.advance(d.forward())
        out["enqueue_share"] = (time.perf_counter() - t0) / eager
        sync(device)
    if not graphs:
        out["graph"] = "SKIP (no CUDA)"
        return out
    try:
        # The server's own graphs (services/worker/decode_graphs.py): page 0 and state slot 0 are the
        # Decoder's unused rows, its scratch. Only this batch's size is captured.
        graphs = DecodeGraphs(model, d.kv, d.state, Scratch(token_slot=0, state_slot=0), max_batch=batch,
                              max_len=d.table.shape[1], device=device)  # fmt: skip
        graphs.sizes = [batch]
        with torch.inference_mode():
            out["graph_capture_s"] = graphs.capture().seconds
            if compare:  # only at the smallest batch: a copy of the pools would be GBs at 128
                # The same inputs through the graph and eagerly, from the same state: the logits must agree.
                pool = [t for layer in d.state.tensors for t in layer.values()]
                saved = [t.clone() for t in pool]
                eager_logits = d.forward().float()
                for t, s in zip(pool, saved, strict=True):
                    t.copy_(s)
                graph_logits = graphs.run(d.fb)
                out["graph_vs_eager_max_abs_diff"] = (graph_logits.float() - eager_logits).abs().max().item()
                del saved
            for _ in range(3):
                d.advance(graphs.run(d.fb))
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                d.advance(graphs.run(d.fb))
            sync(device)
            replay = (time.perf_counter() - t0) / steps
        out.update(graph_ms_per_step=replay * 1e3, graph_tok_per_s=batch / replay)
    except Exception as e:  # the figure says why capture failed; the step goes on
        out["graph"] = f"capture failed: {type(e).__name__}: {str(e)[:300]}"
    return out


def prefill(model, length: int, device: torch.device) -> float:
    d = Decoder.__new__(Decoder)
    d.model, d.device, d.batch = model, device, 1
    pages = -(-length // PAGE)
    d.kv = KVPool(model.kv_spec(), pages + 1, PAGE, device)
    d.state = StatePool(model.state_spec(), 2, device)
    d.table = torch.arange(PAGE, (pages + 1) * PAGE, device=device).view(1, -1)
    d.state_slots = torch.tensor([1], device=device)
    return timed(lambda: d._prefill(length), device, 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--rehearse", action="store_true")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--prefill", default="2048,8192")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.rehearse
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    batches = [int(b) for b in a.batches.split(",")]
    lengths = [int(n) for n in a.prefill.split(",")]
    context, steps = a.context, a.steps
    if a.rehearse:
        batches, lengths, context, steps = [1, 4], [64], 32, 3
    torch.manual_seed(0)
    rates = machine_rates(device, dtype, a.rehearse)
    progress(
        f"copy {rates['copy_bytes_per_s'] / 1e12:.2f} TB/s, matmul {rates['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s"
    )
    model = build(a.rehearse, device, dtype)
    cost = model_cost(model)
    progress(f"model: {cost.params / 1e9:.2f}B params, {str(dtype)} on {device}")
    figures: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype),
        "params": cost.params,
        "context": context,
        **rates,
        "decode": {},
        "prefill": {},
    }
    for b in batches:
        r = decode(model, b, context, steps, device, graphs=cuda, compare=b == batches[0])
        roof_s = cost.decode_bytes(b, context + 1) / rates["copy_bytes_per_s"]  # both count every byte moved
        r["roofline_tok_per_s"] = b / roof_s
        figures["decode"][str(b)] = r
        progress(f"decode batch {b}: {json.dumps(r)}")
        torch.cuda.empty_cache() if cuda else None
    for n in lengths:
        s = prefill(model, n, device)
        roof = cost.prefill_flops(n) / rates["matmul_flop_per_s"]
        figures["prefill"][str(n)] = {"tok_per_s": n / s, "ms": s * 1e3, "roofline_tok_per_s": n / roof}
        progress(f"prefill {n}: {json.dumps(figures['prefill'][str(n)])}")
    if cuda:
        figures["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    a.out.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
