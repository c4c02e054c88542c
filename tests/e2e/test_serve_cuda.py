"""On a GPU, `himamba serve --device cuda` (the Triton twins, chosen by dispatch) streams the greedy
tokens of transformers, as the CPU server does (skipped without a CUDA device and triton)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from himamba.common.client import Client
from himamba.services.modelgen.tokenizer_files import train_demo_tokenizer
from tests.e2e.prompts import random_tokens
from tests.worker.hf_reference import HF_VOCAB, greedy, load_reference, save_tiny

# One module-level skip (not one per case) where there is no GPU to run on.
if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
    pytest.skip("needs a CUDA device and triton", allow_module_level=True)


@pytest.fixture(scope="module", params=["NemotronH", "Qwen3Next", "Jamba"])
def served(request, tmp_path_factory, server_factory):
    d = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, d)
    train_demo_tokenizer(d, vocab_size=HF_VOCAB)
    server = server_factory(d, "--device", "cuda", "--max-total-tokens", "16384", "--max-mamba-cache-size", "64")
    return server, load_reference(d)


def test_greedy_tokens_on_cuda_equal_transformers(served):
    server, ref = served
    with Client(server.endpoint) as c:
        for i, n in enumerate([1, 7, 64, 300]):
            ids = random_tokens(n, seed=i, vocab=HF_VOCAB)
            out = c.generate(input_ids=ids, max_tokens=16, ignore_eos=True)
            assert out.token_ids == greedy(ref, ids, 16), f"prompt length {n}"
