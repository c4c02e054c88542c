"""One decode step of a model on the CUDA code path, on CPU: `python decode_launches_run.py MODEL_DIR OUT BATCHES`.

The caller sets HIMAMBA_KERNELS=triton, TRITON_INTERPRET=1 and HIMAMBA_CUDA_PATH=1 (before anything
imports triton), so the step runs the Triton twins and every CUDA branch. For each batch size (comma
separated), sequences on shuffled state slots are prefilled and decoded one step (a warm-up), then
one decode step (the model's forward and the sampler) is counted with `LaunchCount`. Writes
{"<batch>": {"launches", "triton_launches", "syncs": [[op, where], ...], "ops"}} to OUT as JSON.
`test_decode_launches.py` starts this file, so that the pytest process never imports triton.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `tests.worker`

import torch

from himamba.common.types import SamplingParams
from himamba.services.worker.launch_count import LaunchCount, StepCount
from himamba.services.worker.loader import load_model
from himamba.services.worker.penalties import PenaltyState
from himamba.services.worker.sampler import sample
from tests.worker.harness import Harness


def count_step(model_dir: Path, batch: int) -> StepCount:
    model = load_model(model_dir)
    harness = Harness(model, num_pages=64, num_state_slots=2 * batch + 4, seed=batch)
    seqs = [harness.new_sequence() for _ in range(batch)]
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(3 + 5 * i)] for i in range(batch)]
    # Every row samples (seeded, filtered, penalised): the sampler's whole batched path runs.
    params = [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.1, seed=i)
        for i in range(batch)
    ]
    penalties = []
    for p, prompt in zip(params, prompts, strict=True):
        state = PenaltyState(model.vocab_size, num_prompt=len(prompt), device=torch.device("cpu"))
        state.feed(prompt)
        penalties.append(state)
    logits = harness.prefill(seqs, prompts)
    tokens = sample(logits, params, [0] * batch, penalties).tokens
    logits = harness.decode(seqs, tokens)  # warm-up: first use of every decode kernel
    tokens = sample(logits, params, [1] * batch, penalties).tokens

    forward = model.forward
    count = LaunchCount()

    def counted_forward(*args, **kwargs):
        with count:
            return forward(*args, **kwargs)

    model.forward = counted_forward  # type: ignore[method-assign]
    logits = harness.decode(seqs, tokens)
    with count:
        sample(logits, params, [2] * batch, penalties)
    return count.result()


def main() -> None:
    model_dir, out, batches = Path(sys.argv[1]), Path(sys.argv[2]), [int(b) for b in sys.argv[3].split(",")]
    results = {}
    for batch in batches:
        got = count_step(model_dir, batch)
        results[str(batch)] = {
            "launches": got.launches,
            "triton_launches": got.triton_launches,
            "syncs": [list(s) for s in got.syncs],
            "ops": got.ops,
        }
    out.write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
