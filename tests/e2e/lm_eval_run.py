"""Run lm-eval-harness's tiny local task (tests/data/lm_eval) on one model and write, as JSON,
its accuracy and every request's loglikelihood: `python tests/e2e/lm_eval_run.py MODEL
MODEL_ARGS BATCH_SIZE OUT`. Run from the repository root, in its own process (offline).

MODEL is an lm-eval model (`local-completions` for a server) or `transformers-reference`: the
checkpoint in transformers (float32), scored by lm-eval's own request path (`TemplateLM`:
the same context/continuation tokenization as `local-completions`), without lm-eval's `hf`
model and its extra dependencies (accelerate).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TASK = "himamba_tiny_ll"
TASK_DIR = Path("tests/data/lm_eval")


def _register_reference() -> None:
    import torch
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    @register_model("transformers-reference")
    class TransformersReference(TemplateLM):
        def __init__(self, pretrained: str, **_: object) -> None:
            super().__init__()
            from transformers import AutoModelForCausalLM, AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(pretrained)
            self.model = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32).eval()

        @property
        def eot_token_id(self) -> int:
            return int(self.tokenizer.eos_token_id)

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_: object) -> list[int]:
            # As local-completions with tokenizer_backend=huggingface (add_bos_token off).
            return self.tokenizer(string, add_special_tokens=bool(add_special_tokens)).input_ids

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_: object):  # type: ignore[no-untyped-def]
            out = []
            for _pair, context, continuation in requests:
                ids = torch.tensor([context + continuation])
                with torch.no_grad():
                    logprobs = torch.log_softmax(self.model(ids).logits[0].float(), dim=-1)
                rows = logprobs[len(context) - 1 : len(context) + len(continuation) - 1]
                target = torch.tensor(continuation)
                ll = rows.gather(1, target.view(-1, 1)).sum().item()
                out.append((ll, bool((rows.argmax(dim=-1) == target).all())))
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):  # type: ignore[no-untyped-def]
            raise NotImplementedError("the tiny task needs loglikelihood only")

        def generate_until(self, requests, disable_tqdm: bool = False):  # type: ignore[no-untyped-def]
            raise NotImplementedError("the tiny task needs loglikelihood only")


def main(model: str, model_args: str, batch_size: int, out: Path) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if model == "transformers-reference":
        _register_reference()  # (registering a model first would hide lm-eval's lazily listed ones)
    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASK_DIR)),
        batch_size=batch_size,
        log_samples=True,
    )
    assert results is not None
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    lls = [[float(resp[0]) for resp in s["filtered_resps"]] for s in samples]
    greedy = [[bool(resp[1]) for resp in s["filtered_resps"]] for s in samples]
    acc = results["results"][TASK]["acc,none"]
    out.write_text(json.dumps({"acc": acc, "loglikelihoods": lls, "is_greedy": greedy}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
