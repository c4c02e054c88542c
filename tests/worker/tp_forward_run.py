"""One rank of a tensor-parallel forward on the CPU: `python tp_forward_run.py RANK SIZE INIT OUT MODEL_DIR...`.

Joins a gloo group of SIZE ranks at INIT (a file:// store); for each MODEL_DIR, loads it sharded, prefills
three prompts together (crossing page boundaries) and decodes them greedily; rank 0 writes
{MODEL_DIR: {"tokens": [[...]], "logits": [[...]]}} (the prefill's last-token logits) to OUT as JSON.
`test_tensor_parallel_forward.py` starts one per rank (one group for every model: a start costs seconds).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: the repo root, for `tests.worker` (never in pytest's own path)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from himamba.services.worker import tensor_parallel
from himamba.services.worker.loader import load_model
from tests.worker.harness import Harness

PROMPTS = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((5, 40, 70))]
NEW_TOKENS = 8


def main(rank: int, size: int, init: str, out: str, model_dirs: list[str]) -> None:
    torch.set_num_threads(1)
    if size > 1:
        tensor_parallel.init_group(rank, size, init, torch.device("cpu"), timeout_s=120)
    results = {d: run(d) for d in model_dirs}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    tensor_parallel.close_group()


def run(model_dir: str) -> dict:
    model = load_model(Path(model_dir))
    harness = Harness(model, page_size=16)
    seqs = [harness.new_sequence() for _ in PROMPTS]
    logits = harness.prefill(seqs, PROMPTS)
    first = logits.clone()
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    for step in range(NEW_TOKENS):
        next_ids = logits.argmax(-1).tolist()
        for t, n in zip(tokens, next_ids, strict=True):
            t.append(n)
        if step + 1 < NEW_TOKENS:
            logits = harness.decode(seqs, next_ids)
    return {"tokens": tokens, "logits": first.tolist()}


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:])
