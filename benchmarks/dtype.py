"""`kvrelay bench dtype`: the engine's numerics against the fp32 reference on SmolLM2,
fidelity and speed side by side.

Three engines on the same model: the fp32 reference (dense fp32 weights, oneDNN packed:
what the engine served before int4), bf16 (`--dtype bfloat16`) and int4 (`--linear-kernel
int4`: decode on the 4/8-bit blocks, prefill on their dense values; on the default model
these store its weights exactly, so only the order of sums changes).

The prompts are real agent-framework chats (the captured workloads, tests/data/agents),
rendered with the model's chat template and cut to at most `max_prompt` tokens. The
fidelity harness (engine_ext/fidelity.py) judges:

- each candidate against fp32: fp32's dense greedy continuation teacher-forced through
  the candidate (top-1 agreement, mean KL(fp32 || candidate)) and whether free greedy
  decoding of 32 tokens is identical. This is what changing the numerics changes.
- each engine against itself, the bar exact methods must meet (top-1 1.0, KL < 1e-4):
  a prefix-cache hit (the first ~90% of the prompt cached by an earlier request) and a
  batch (every prompt in one batch, the dense continuation teacher-forced for top-1 and
  KL, free-running for greedy) against the same engine's dense solo run.
  Judged in its own numerics, as an exact method would be served in them.

Speed: prefill tok/s at 1024 tokens and decode tok/s at batch 1 and 8, measured as
`kvrelay bench engine` measures them, the engines alternating.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.agents.workload import load_all
from benchmarks.common import BenchResult, best_of
from benchmarks.engine import PromptSource, engine_decode_tps, engine_prefill
from engine_ext.config import EngineConfig
from engine_ext.engine import LLMEngine
from engine_ext.fidelity import DenseReference, FidelityHarness, compare_logits
from engine_ext.model_store import resolve_model
from engine_ext.request import EngineRequest
from engine_ext.sampling import SamplingParams
from engine_ext.sequence import Sequence

DTYPES = ("float32", "bfloat16")
EXACT_TOP1, EXACT_KL = 1.0, 1e-4  # DESIGN's bar for exact methods


def chat_prompts(engine: LLMEngine, count: int, max_prompt: int) -> list[list[int]]:
    """Token ids of `count` captured chats (spread over the apps), rendered for the model."""
    requests = [r for w in load_all() for r in w.requests if r.body.get("messages")]
    step = max(1, len(requests) // count)
    prompts = []
    for request in requests[::step][:count]:
        messages = [{"role": m["role"], "content": m["content"]} for m in request.body["messages"]
                    if m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)]
        text = engine.tokenizer.render_chat(messages)
        prompts.append(engine.tokenizer.encode(text)[-max_prompt:])
    return prompts


def self_exactness(engine: LLMEngine, harness: FidelityHarness, prompts: list[list[int]]) -> dict[str, float]:
    """Prefix hit and batched decode, each against the engine's own dense solo run."""
    block = engine.config.block_size
    hit_top1, hit_kl, hit_greedy, batch_top1, batch_kl, batch_greedy = [], [], [], [], [], []
    references = []
    for prompt in prompts:
        engine.kv.pool.reset_cache()
        references.append(reference := harness.reference(prompt))
        ids = reference.prompt_ids
        cached = (len(ids) * 9 // 10) // block * block
        engine.generate(ids[:cached], SamplingParams(max_tokens=1, temperature=0.0))  # publishes the prefix
        if engine.generate(ids, SamplingParams(max_tokens=1, temperature=0.0), publish=False).num_cached_tokens < cached:
            raise RuntimeError("the prefix-hit run found its prefix uncached")
        result = harness.measure(ids, [], reference)
        hit_top1.append(result.top1_agreement)
        hit_kl.append(result.kl)
        hit_greedy.append(float(result.greedy_match))
    forced = _batch(engine, references, harness.num_tokens, teacher_forced=True)
    free = _batch(engine, references, harness.num_tokens, teacher_forced=False)
    for scored, greedy, reference in zip(forced, free, references):
        top1, kl = compare_logits(reference.logits, torch.stack(scored.logits or []))
        batch_top1.append(top1)
        batch_kl.append(kl)
        batch_greedy.append(float(greedy.output_token_ids == reference.continuation))
    return {"prefix_hit_top1": min(hit_top1), "prefix_hit_kl": max(hit_kl), "prefix_hit_greedy": min(hit_greedy),
            "batched_top1": min(batch_top1), "batched_kl": max(batch_kl), "batched_greedy": min(batch_greedy)}


def _batch(engine: LLMEngine, references: list[DenseReference], num_tokens: int,
           teacher_forced: bool) -> list[Sequence]:
    """Every reference prompt in one batch from a cold cache; teacher-forced ones are fed
    the reference continuation (their logits then score the same contexts as the reference's)."""
    engine.kv.pool.reset_cache()
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    seqs = []
    for i, reference in enumerate(references):
        seq = engine.add_request(EngineRequest(f"dtype-batch-{i}-{time.monotonic_ns()}", reference.prompt_ids,
                                               params, publish=False))
        if teacher_forced:
            seq.forced_token_ids, seq.logits = list(reference.continuation), []
        seqs.append(seq)
    while engine.has_work:
        engine.step()
    return seqs


def cross_fidelity(fp32: FidelityHarness, bf16: FidelityHarness, prompts: list[list[int]]) -> dict[str, float]:
    """fp32's dense continuation teacher-forced through bf16; greedy continuations compared."""
    top1, kl, greedy = [], [], []
    for prompt in prompts:
        for harness in (fp32, bf16):
            harness.engine.kv.pool.reset_cache()
        reference, own = fp32.reference(prompt), bf16.reference(prompt)
        scored = bf16.engine.score(reference.prompt_ids, reference.continuation, publish=False)
        t, k = compare_logits(reference.logits, scored.logits)
        top1.append(t)
        kl.append(k)
        greedy.append(float(own.continuation == reference.continuation))
    return {"top1_mean": statistics.fmean(top1), "top1_min": min(top1), "kl_mean": statistics.fmean(kl),
            "kl_max": max(kl), "greedy_match": statistics.fmean(greedy)}


# Each engine's config; "fp32" is the reference the others are judged against.
VARIANTS: dict[str, EngineConfig] = {
    "fp32": EngineConfig(kv_cache_bytes=512 * 2**20, dtype="float32", linear_kernel="packed"),
    "bf16": EngineConfig(kv_cache_bytes=512 * 2**20, dtype="bfloat16"),
    "int4": EngineConfig(kv_cache_bytes=512 * 2**20, dtype="float32", linear_kernel="int4"),
}
CANDIDATES = ("bf16", "int4")
DEFAULT_TOP1 = 0.99  # a candidate's top-1 against fp32 must reach this to be served by default


def run(quick: bool, model: str | None) -> BenchResult:
    model_dir = resolve_model(model)
    count, max_prompt, repeats, decode_tokens = (6, 768, 2, 16) if quick else (24, 1536, 3, 64)
    engines = {name: LLMEngine(model_dir, config) for name, config in VARIANTS.items()}
    harnesses = {name: FidelityHarness(e) for name, e in engines.items()}
    prompts = chat_prompts(engines["fp32"], count, max_prompt)
    metrics: dict[str, float] = {}
    rows: list[tuple[str, str, str, str]] = []

    cross = {c: cross_fidelity(harnesses["fp32"], harnesses[c], prompts) for c in CANDIDATES}
    for c in CANDIDATES:
        metrics.update({f"{c}_vs_fp32_{k}": v for k, v in cross[c].items()})
    rows.append(("vs fp32: teacher-forced top-1, mean (min)",
                 *(f"{cross[c]['top1_mean']:.4f} ({cross[c]['top1_min']:.4f})" for c in CANDIDATES), "1.0"))
    rows.append(("vs fp32: KL(fp32 || candidate), mean (max)",
                 *(f"{cross[c]['kl_mean']:.2e} ({cross[c]['kl_max']:.2e})" for c in CANDIDATES), "0"))
    rows.append(("vs fp32: greedy 32 tokens identical", *(f"{cross[c]['greedy_match']:.3f}" for c in CANDIDATES),
                 "1.0"))

    exact = {name: self_exactness(engines[name], harnesses[name], prompts) for name in VARIANTS}
    for name in VARIANTS:
        metrics.update({f"{name}_{k}": v for k, v in exact[name].items()})
    for case in ("prefix_hit", "batched"):
        rows.append((f"{case.replace('_', ' ')} vs own dense: top-1 min, KL max, greedy",
                     *(_exact_cell(exact[name], case) for name in (*CANDIDATES, "fp32"))))
    for c in CANDIDATES:
        metrics[f"{c}_meets_exact_bar"] = float(all(
            exact[c][f"{case}_top1"] >= EXACT_TOP1 and exact[c][f"{case}_kl"] < EXACT_KL
            for case in ("prefix_hit", "batched")))
        metrics[f"{c}_may_be_default"] = float(metrics[f"{c}_meets_exact_bar"] == 1.0
                                               and cross[c]["top1_mean"] >= DEFAULT_TOP1)
    rows.append(("meets the exact bar; may be the default (top-1 vs fp32 >= 0.99)",
                 *(f"{metrics[f'{c}_meets_exact_bar']:.0f}; {metrics[f'{c}_may_be_default']:.0f}"
                   for c in CANDIDATES), ""))

    source = PromptSource(engines["fp32"].model_config.vocab_size)
    prefill = {name: 1024 / best_of(lambda e=engines[name]: engine_prefill(e, source, 1024), repeats)
               for name in VARIANTS}
    rows.append(("prefill tok/s @ 1024", *(f"{prefill[name]:.0f}" for name in (*CANDIDATES, "fp32"))))
    for c in CANDIDATES:
        metrics[f"{c}_prefill_speedup"] = prefill[c] / prefill["fp32"]
    for batch in (1, 8):
        tps = {name: max(engine_decode_tps(engines[name], source, batch, 64, decode_tokens) for _ in range(repeats))
               for name in VARIANTS}
        rows.append((f"decode tok/s @ batch {batch}", *(f"{tps[name]:.1f}" for name in (*CANDIDATES, "fp32"))))
        for c in CANDIDATES:
            metrics[f"{c}_decode_speedup_b{batch}"] = tps[c] / tps["fp32"]
        metrics.update({f"{name}_decode_tps_b{batch}": tps[name] for name in VARIANTS})
    for engine in engines.values():
        engine.close()
    config = {"model": model_dir.name, "quick": quick, "prompts": len(prompts), "max_prompt_tokens": max_prompt,
              "fidelity_tokens": harnesses["fp32"].num_tokens, "exact_bar": {"top1": EXACT_TOP1, "kl": EXACT_KL},
              "default_top1": DEFAULT_TOP1, "prompt_lengths": [len(p) for p in prompts],
              "variants": {name: {"dtype": c.dtype, "linear_kernel": c.linear_kernel} for name, c in VARIANTS.items()}}
    return BenchResult("dtype", metrics, config, rows, headers=("measure", "bf16", "int4", "fp32 (reference)"))


def _exact_cell(values: dict[str, float], case: str) -> str:
    return f"{values[f'{case}_top1']:.3f}, {values[f'{case}_kl']:.1e}, {values[f'{case}_greedy']:.2f}"
