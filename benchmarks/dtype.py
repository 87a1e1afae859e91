"""`kvrelay bench dtype`: bf16 against fp32 on SmolLM2, fidelity and speed side by side.

The prompts are real agent-framework chats (the captured workloads, tests/data/agents),
rendered with the model's chat template and cut to at most `max_prompt` tokens. Each
dtype runs its own engine, and the fidelity harness (engine_ext/fidelity.py) judges:

- bf16 against fp32: fp32's dense greedy continuation teacher-forced through the bf16
  engine (top-1 agreement, mean KL(fp32 || bf16)) and whether free greedy decoding of
  32 tokens is identical. This is what changing the served dtype changes.
- each dtype against itself, the bar exact methods must meet (top-1 1.0, KL < 1e-4):
  a prefix-cache hit (the first ~90% of the prompt cached by an earlier request) and a
  batch (every prompt in one batch, the dense continuation teacher-forced for top-1 and
  KL, free-running for greedy) against the same engine's dense solo run.
  Judged in the same dtype, as an exact method would be served in it.

Speed: prefill tok/s at 1024 tokens and decode tok/s at batch 1 and 8, measured as
`kvrelay bench engine` measures them, the two engines alternating.
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


def run(quick: bool, model: str | None) -> BenchResult:
    model_dir = resolve_model(model)
    count, max_prompt, repeats, decode_tokens = (6, 768, 2, 16) if quick else (24, 1536, 3, 64)
    engines = {d: LLMEngine(model_dir, EngineConfig(kv_cache_bytes=512 * 2**20, dtype=d)) for d in DTYPES}
    harnesses = {d: FidelityHarness(e) for d, e in engines.items()}
    prompts = chat_prompts(engines["float32"], count, max_prompt)
    metrics: dict[str, float] = {}
    rows: list[tuple[str, str, str, str]] = []

    cross = cross_fidelity(harnesses["float32"], harnesses["bfloat16"], prompts)
    metrics.update({f"bf16_vs_fp32_{k}": v for k, v in cross.items()})
    rows.append(("bf16 vs fp32: teacher-forced top-1, mean (min)", f"{cross['top1_mean']:.4f} "
                 f"({cross['top1_min']:.4f})", "1.0 (fp32)", ""))
    rows.append(("bf16 vs fp32: KL(fp32 || bf16), mean (max)", f"{cross['kl_mean']:.2e} ({cross['kl_max']:.2e})",
                 "0 (fp32)", ""))
    rows.append(("bf16 vs fp32: greedy 32 tokens identical", f"{cross['greedy_match']:.3f}", "1.0 (fp32)", ""))

    exact = {d: self_exactness(engines[d], harnesses[d], prompts) for d in DTYPES}
    short = {"float32": "fp32", "bfloat16": "bf16"}
    for d in DTYPES:
        metrics.update({f"{short[d]}_{k}": v for k, v in exact[d].items()})
    for case in ("prefix_hit", "batched"):
        rows.append((f"{case.replace('_', ' ')} vs own dense: top-1 min, KL max, greedy (bf16 | fp32)",
                     _exact_cell(exact["bfloat16"], case), _exact_cell(exact["float32"], case), ""))
    passes = all(exact["bfloat16"][f"{c}_top1"] >= EXACT_TOP1 and exact["bfloat16"][f"{c}_kl"] < EXACT_KL
                 for c in ("prefix_hit", "batched"))
    metrics["bf16_meets_exact_bar"] = float(passes)

    source = PromptSource(engines["float32"].model_config.vocab_size)
    prefill = {d: 1024 / best_of(lambda e=engines[d]: engine_prefill(e, source, 1024), repeats) for d in DTYPES}
    rows.append(("prefill tok/s @ 1024 (bf16 | fp32)", f"{prefill['bfloat16']:.0f}", f"{prefill['float32']:.0f}",
                 f"{prefill['bfloat16'] / prefill['float32']:.2f}x"))
    metrics["bf16_prefill_speedup"] = prefill["bfloat16"] / prefill["float32"]
    for batch in (1, 8):
        tps = {d: max(engine_decode_tps(engines[d], source, batch, 64, decode_tokens) for _ in range(repeats))
               for d in DTYPES}
        rows.append((f"decode tok/s @ batch {batch} (bf16 | fp32)", f"{tps['bfloat16']:.1f}", f"{tps['float32']:.1f}",
                     f"{tps['bfloat16'] / tps['float32']:.2f}x"))
        metrics[f"bf16_decode_speedup_b{batch}"] = tps["bfloat16"] / tps["float32"]
        metrics.update({f"{short[d]}_decode_tps_b{batch}": tps[d] for d in DTYPES})
    for engine in engines.values():
        engine.close()
    config = {"model": model_dir.name, "quick": quick, "prompts": len(prompts), "max_prompt_tokens": max_prompt,
              "fidelity_tokens": harnesses["float32"].num_tokens, "exact_bar": {"top1": EXACT_TOP1, "kl": EXACT_KL},
              "prompt_lengths": [len(p) for p in prompts]}
    return BenchResult("dtype", metrics, config, rows,
                       headers=("measure", "bf16", "fp32", "bf16/fp32"))


def _exact_cell(values: dict[str, float], case: str) -> str:
    return f"{values[f'{case}_top1']:.3f}, {values[f'{case}_kl']:.1e}, {values[f'{case}_greedy']:.2f}"
