"""Tensor parallelism in the model itself: two gloo ranks (processes, `tp_forward_run.py`) give the
greedy tokens and logits of one process; shards take the right slices; a configuration that cannot be
split is refused when the model is built, naming the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from himamba.services.worker import tensor_parallel
from himamba.services.worker.loader import load_model
from himamba.services.worker.tensor_parallel import Group, replicated_heads, split, use_group
from tests.worker import tp_forward_run
from tests.worker.hf_reference import save_tiny, save_varied

RUNNER = Path(tp_forward_run.__file__)


def _run_tp2(model_dirs: list[str], tmp_path: Path) -> dict:
    out = tmp_path / "tp2.json"
    init = f"file://{tmp_path / 'store'}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
    procs = [
        subprocess.Popen([sys.executable, str(RUNNER), str(r), "2", init, str(out), *model_dirs], env=env)
        for r in (0, 1)
    ]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0]
    return json.loads(out.read_text())


CASES = {
    # Every NemotronH layer kind; groups and KV heads split.
    "nemotron_h": lambda d: save_tiny("NemotronH", d),
    # Gated attention and the gated delta rule (key heads split with their value heads), MoE.
    "qwen3_next": lambda d: save_tiny("Qwen3Next", d),
    # One Mamba2 group (replicated, the norm across ranks), as published Granite-4.0-H checkpoints.
    "granite_one_group": lambda d: save_tiny("GraniteMoeHybrid", d, mamba_n_groups=1),
    # One KV head (replicated), MoE experts sliced, tied (replicated) head.
    "granite_varied": lambda d: save_varied("GraniteMoeHybrid", d),
}


def test_two_ranks_equal_one_process(tmp_path):
    dirs = {case: str(save(tmp_path / case)) for case, save in CASES.items()}
    two = _run_tp2(list(dirs.values()), tmp_path)
    for case, d in dirs.items():
        one = tp_forward_run.run(d)
        assert two[d]["tokens"] == one["tokens"], case
        torch.testing.assert_close(
            torch.tensor(two[d]["logits"]), torch.tensor(one["logits"]), rtol=1e-4, atol=1e-4, msg=case
        )


def test_shards_take_their_slices():
    full = torch.arange(12).reshape(12, 1)
    # [a(4) | b(4) | c(4)]: each part cut in two, part 1 kept whole.
    shard = split(0, (4, 4, 4), whole=frozenset({1}))
    assert shard(full, Group(1, 2)).flatten().tolist() == [2, 3, 4, 5, 6, 7, 10, 11]
    # Two KV heads of size 2 over four ranks: ranks 0-1 read head 0, ranks 2-3 head 1.
    heads = replicated_heads(0, 2, 2)
    assert [heads(full[:4], Group(r, 4)).flatten().tolist() for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]


@pytest.fixture
def two_ranks():
    use_group(Group(0, 2))  # only the sizes: nothing here reaches a collective
    yield
    use_group(Group())


def test_unsplittable_config_is_refused_with_the_reason(tmp_path, two_ranks):
    model_dir = save_varied("NemotronH", tmp_path / "m")  # n_groups 3
    with pytest.raises(ValueError, match=r"n_groups.*\(3\) is not divisible by --tensor-parallel-size 2"):
        load_model(model_dir)


def test_family_without_sharding_is_refused(tmp_path, two_ranks):
    model_dir = save_tiny("Jamba", tmp_path / "m")
    with pytest.raises(ValueError, match="JambaForCausalLM is not sharded yet"):
        load_model(model_dir)


def test_a_group_of_one_is_untouched():
    assert tensor_parallel.group() == Group()
    x = torch.ones(3)
    assert tensor_parallel.all_reduce(x) is x
    assert tensor_parallel.all_gather_last(x) is x


def test_ranks_on_the_cpu_split_the_cores_this_process_may_use(monkeypatch):
    # A container pinned to 2 cores of a 64-core host: os.cpu_count() says 64, torch's default says 2.
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(tensor_parallel.torch, "get_num_threads", lambda: 2)
    assert tensor_parallel.threads_per_rank(2) == 1
    assert tensor_parallel.threads_per_rank(4) == 1
