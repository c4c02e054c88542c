"""`himamba bench launches`: what one worker step would launch on a GPU, and where it would wait, counted on CPU.

One decode step (per `--batch` size) and one prefill step (per `--prefill-seqs` count; 24 tokens a sequence,
with captures asked at offsets 16 and 21 of each) of a tiny model of
`--arch` with random weights run through the worker's own step (RunBatch -> build_forward_batch ->
model.forward -> sample, bench_forward's OurEngine) on the CUDA code path: HIMAMBA_KERNELS=triton,
TRITON_INTERPRET=1 and HIMAMBA_CUDA_PATH=1 (`dispatch.cuda_path`), set before triton is imported (the
command re-runs itself with them). `worker/launch_count.py` counts:

- launches: every Triton kernel launch plus every aten op that would launch a CUDA kernel (views and
  allocation-only ops excluded; the list is `launch_count.ALLOCATIONS` and `OpOverload.is_view`);
- syncs: every op that would make the host wait for the device (`launch_count.SYNC_OPS`, boolean-mask
  indexing, `tolist` / `numpy` / `cpu`), apart from
- token_reads: the sampler's one read of the sampled ids (and their failure codes) per step.

`--experts N` sets the routed experts of a MoE family (nemotron_h, granite_hybrid, qwen3_next, jamba;
granite_hybrid is dense unless it is given). Writes DIR/launches.json:
{"arch", "experts", "decode": {"<batch>": {"launches", "syncs", "token_reads"}}, "prefill": {"<seqs>": {...}}}
and prints a table with each size's ratio to the smallest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_ENV = {"HIMAMBA_KERNELS": "triton", "TRITON_INTERPRET": "1", "HIMAMBA_CUDA_PATH": "1"}
# Where each MoE family's config names its routed experts.
_EXPERT_KEYS = {
    "nemotron_h": "n_routed_experts",
    "granite_hybrid": "num_local_experts",
    "qwen3_next": "num_experts",
    "jamba": "num_experts",
}
_TOKEN_READ = ("tolist", "sampler.py")  # the sampler's read of the sampled ids


def _config(arch: str, experts: int | None) -> dict[str, Any]:
    from himamba.services.modelgen.family_configs import FAMILY_CONFIGS, family_config
    from himamba.services.modelgen.hf_configs import granite_hybrid_config, nemotron_h_config

    vocab = 512
    if arch == "nemotron_h":
        cfg = nemotron_h_config("tiny", vocab)
    elif arch == "granite_hybrid":
        cfg = granite_hybrid_config("tiny", vocab)
    elif arch in FAMILY_CONFIGS:
        cfg = family_config(arch, vocab)
    else:
        raise ValueError(f"--arch must be one of nemotron_h, granite_hybrid, {', '.join(FAMILY_CONFIGS)}")
    if experts is not None:
        if arch not in _EXPERT_KEYS:
            raise ValueError(f"--experts applies to the MoE families ({', '.join(_EXPERT_KEYS)}), not {arch}")
        cfg[_EXPERT_KEYS[arch]] = experts
        top_k = cfg.get("num_experts_per_tok", 2)
        if experts < top_k:
            raise ValueError(f"--experts {experts} is fewer than the {top_k} experts each token picks")
    return cfg


def _model(arch: str, experts: int | None):
    import torch

    from himamba.services.worker.models.hf_config import read_config_json
    from himamba.services.worker.models.registry import architecture_of, model_class

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(_config(arch, experts)))
        raw = read_config_json(Path(tmp))
    model = model_class(architecture_of(raw)).from_hf_config(raw, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def _counted(engine, mode: str, seqs, tokens, captures=None) -> dict[str, int]:
    from himamba.bench.forward import StepTimes
    from himamba.services.worker.launch_count import LaunchCount

    count = LaunchCount()
    engine.step(mode, seqs, tokens, StepTimes(), around=count, captures=captures)  # RunBatch in, tokens out
    got = count.result()
    reads = [s for s in got.syncs if s.op == _TOKEN_READ[0] and s.where.startswith(_TOKEN_READ[1])]
    return {"launches": got.launches, "syncs": len(got.syncs) - len(reads), "token_reads": len(reads)}


def measure(arch: str, experts: int | None, batches: list[int], prefill_seqs: list[int]) -> dict[str, Any]:
    """Counts of one decode step per batch size and one prefill step per sequence count."""
    from himamba.bench.forward import OurEngine, StepTimes

    model = _model(arch, experts)
    most = max(batches + prefill_seqs)
    out: dict[str, Any] = {"arch": arch, "experts": experts, "decode": {}, "prefill": {}}
    for n in prefill_seqs:
        engine = OurEngine(model, page_size=16, max_tokens=most * 64, max_seqs=3 * most + 2)
        seqs = [engine.new_seq() for _ in range(n)]
        # Two captures per sequence, as the cache asks of a prompt: at a page boundary and inside a page.
        captures = [[(16, engine.take_slot()), (21, engine.take_slot())] for _ in range(n)]
        out["prefill"][str(n)] = _counted(
            engine, "prefill", seqs, [[(5 * i + j) % 500 + 1 for j in range(24)] for i in range(n)], captures
        )
    for b in batches:
        engine = OurEngine(model, page_size=16, max_tokens=most * 64, max_seqs=2 * most + 2)
        seqs = [engine.new_seq() for _ in range(b)]
        engine.step("prefill", seqs, [[(3 * i + j) % 500 + 1 for j in range(5 + i % 7)] for i in range(b)], StepTimes())
        engine.step("decode", seqs, [[s.last_token] for s in seqs], StepTimes())  # first use of each decode kernel
        out["decode"][str(b)] = _counted(engine, "decode", seqs, [[s.last_token] for s in seqs])
    return out


def _table(result: dict[str, Any]) -> str:
    lines = [f"{result['arch']}" + (f", {result['experts']} experts" if result["experts"] else "")]
    for mode, label in (("decode", "batch"), ("prefill", "seqs")):
        rows = result[mode]
        if not rows:
            continue
        base = rows[min(rows, key=int)]["launches"]
        lines.append(f"  {mode:<8}{label:>6} {'launches':>9} {'x smallest':>10} {'syncs':>6} {'token reads':>12}")
        for size in sorted(rows, key=int):
            r = rows[size]
            lines.append(
                f"  {'':<8}{size:>6} {r['launches']:>9} {r['launches'] / base:>10.3f} {r['syncs']:>6} {r['token_reads']:>12}"
            )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="himamba bench launches", description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="nemotron_h", help="model family (default nemotron_h)")
    p.add_argument("--batch", type=_ints, default=[1, 8, 32], help="decode batch sizes (default 1,8,32)")
    p.add_argument("--prefill-seqs", type=_ints, default=[1, 8], help="prefill sequence counts (default 1,8)")
    p.add_argument("--experts", type=int, default=None, help="routed experts of a MoE family")
    p.add_argument("--out", type=Path, default=Path("."), help="folder for launches.json")
    a = p.parse_args(argv)
    _config(a.arch, a.experts)  # bad arguments are refused before anything runs
    if any(os.environ.get(k) != v for k, v in _ENV.items()):
        # The interpreter must be chosen before triton is first imported: run again with it.
        env = {**os.environ, **_ENV}
        cmd = [
            sys.executable,
            "-P",
            "-m",
            "himamba.bench.launches",
            *(argv if argv is not None else sys.argv[1:]),
        ]
        return subprocess.run(cmd, env=env).returncode
    result = measure(a.arch, a.experts, a.batch, a.prefill_seqs)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "launches.json").write_text(json.dumps(result, indent=1))
    print(_table(result))
    print(f"wrote {a.out / 'launches.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
