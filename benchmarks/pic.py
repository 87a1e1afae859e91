"""`kvrelay bench pic`: position-independent caching in KVLink's setting.

A question follows 10 documents of N tokens each; the documents were cached
beforehand, each prefilled alone (so its KV knows nothing of what will precede it).
Every method answers the same token ids (segment-aligned: each document tokenized
alone), side by side in one run:
- dense: every token computed (the baseline);
- prefix: the prefix cache only (the shared system prompt hits; documents do not);
- shift: documents' KV moved to their positions by a RoPE shift (KVLink-0 / PromptCache);
- blend: shift + CacheBlend's recompute of the 15% most deviating tokens;
- link: shift + recompute of the first link_tokens tokens of every document.
TTFT is the best of a few runs; fidelity (top1 agreement, KL, greedy match against
the dense path, DESIGN.md) is averaged over several questions at the largest N.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass

from benchmarks.common import BenchResult
from engine_ext.config import EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.fidelity import FidelityHarness, FidelityResult
from engine_ext.model_store import resolve_model
from engine_ext.reuse.segments import TokenSegment
from engine_ext.sampling import SamplingParams

METHODS = ("prefix", "shift", "blend", "link")
NUM_DOCS = 10
SYSTEM = ("<|im_start|>system\nYou are a helpful assistant. Answer the question using the documents."
          "<|im_end|>\n<|im_start|>user\n")


@dataclass(frozen=True)
class Sizes:
    doc_lens: tuple[int, ...]
    ttft_repeats: int
    num_questions: int  # fidelity prompts at the largest N
    num_fidelity_tokens: int


QUICK = Sizes(doc_lens=(200,), ttft_repeats=2, num_questions=1, num_fidelity_tokens=32)
FULL = Sizes(doc_lens=(100, 300, 500), ttft_repeats=3, num_questions=4, num_fidelity_tokens=32)

_SYLLABLES = ("vel", "mor", "an", "tis", "ka", "ren", "dor", "lu", "pha", "sen", "gri", "ost")
_TRADES = ("wool", "salt", "glass", "timber", "copper", "honey", "silk", "barley")
_RIVERS = ("Alder", "Mirren", "Coldwater", "Seld", "Ouse", "Tarn")


def _town(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(3)).capitalize()


def _document(k: int, rng: random.Random) -> tuple[str, str, int]:
    """A fictional gazetteer entry: (text, town, population), long enough for any N."""
    town, population = _town(rng), rng.randrange(2_000, 90_000)
    facts = [f"Document {k}. This entry describes the town of {town}.",
             f"{town} has a population of {population} people.",
             f"It was founded in {rng.randrange(1100, 1900)} beside the river {rng.choice(_RIVERS)}."]
    for year in range(40):
        trade = rng.choice(_TRADES)
        facts.append(f"In {1700 + 5 * year} the people of {town} traded {trade} with "
                     f"{_town(rng)}, and the market grew by {rng.randrange(2, 30)} stalls.")
    return " ".join(facts), town, population


class Prompts:
    """Token ids of the system prefix, the documents and the questions, each tokenized alone."""

    def __init__(self, engine: LLMEngine, doc_len: int, seed: int = 0) -> None:
        tok = engine.tokenizer
        rng = random.Random(seed)
        self.system = tok.encode(SYSTEM)
        newline = tok.encode("\n\n")
        self.docs, self.towns = [], []
        for k in range(1, NUM_DOCS + 1):
            text, town, _ = _document(k, rng)
            self.docs.append(tok.encode(text)[: doc_len - len(newline)] + newline)
            self.towns.append(town)
        self.tokenizer = tok

    def question(self, q: int) -> list[int]:
        doc = q % NUM_DOCS
        text = (f"Question: according to Document {doc + 1}, what is the population of "
                f"{self.towns[doc]}?<|im_end|>\n<|im_start|>assistant\n")
        return self.tokenizer.encode(text)

    def prompt(self, q: int, method: str | None) -> tuple[list[int], list[TokenSegment]]:
        """The prompt's ids and, for a reuse method, one segment per document. The
        prefix-only path gets no segments: it must not register documents in context
        (which would hand the other methods an exact copy)."""
        ids, segments = list(self.system), []
        for i, doc in enumerate(self.docs):
            segments.append(TokenSegment(len(ids), len(ids) + len(doc), "shared_block", f"doc{i}", method, i))
            ids += doc
        return ids + self.question(q), segments if method not in (None, "prefix") else []


def _ttft(engine: LLMEngine, ids: list[int], segments: list[TokenSegment]) -> float:
    start = time.perf_counter()
    seq = engine.generate(ids, SamplingParams(max_tokens=1, temperature=0.0), segments=segments, publish=False)
    took = time.perf_counter() - start
    _check_placed(seq.reuse_outcomes or [], segments)
    return took


def _check_placed(outcomes: list, segments: list[TokenSegment]) -> None:
    """Every document must have been reused as asked: a fallback (an evicted document)
    would make the run measure something else."""
    missed = [o for o in outcomes if o.method != o.segment.method]
    if len(outcomes) != len(segments) or missed:
        raise RuntimeError(f"{len(missed)} documents were not reused as planned: "
                           f"{missed[0].reason if missed else 'no outcome'}; raise the KV budget")


def _cache(engine: LLMEngine, prompts: Prompts) -> None:
    """Documents alone into the segment index; the system prompt into the prefix cache."""
    for i, doc in enumerate(prompts.docs):
        engine.generate(doc, SamplingParams(max_tokens=1), publish=False,  # shift: opted in, so the document is kept
                        segments=[TokenSegment(0, len(doc), "shared_block", f"doc{i}", "shift")])
    engine.generate(prompts.system + prompts.question(0), SamplingParams(max_tokens=1))


def _fidelity(engine: LLMEngine, prompts: Prompts, sizes: Sizes) -> dict[str, list[FidelityResult]]:
    harness = FidelityHarness(engine, sizes.num_fidelity_tokens)
    out: dict[str, list[FidelityResult]] = {m: [] for m in METHODS}
    for q in range(sizes.num_questions):
        ids, _ = prompts.prompt(q, None)
        reference = harness.reference(ids)
        for method in METHODS:
            segments = prompts.prompt(q, method)[1]
            result = harness.measure(ids, segments, reference)
            _check_placed(result.reuse_outcomes, segments)
            out[method].append(result)
    return out


def run(quick: bool, model: str | None) -> BenchResult:
    sizes = QUICK if quick else FULL
    reuse = ReuseConfig()
    # 3 GiB: room for the documents of every N, so the LRU never evicts the ones in use.
    config = EngineConfig(kv_cache_bytes=3072 * 2**20, max_num_batched_tokens=8192, reuse=reuse)
    engine = LLMEngine(resolve_model(model), config)
    rows: list[tuple[str, str, str, str]] = []
    metrics: dict[str, float] = {}
    for doc_len in sizes.doc_lens:
        prompts = Prompts(engine, doc_len)
        _cache(engine, prompts)
        ids, _ = prompts.prompt(0, None)
        dense = min(_ttft(engine, ids, []) for _ in range(sizes.ttft_repeats))
        metrics[f"ttft_ms_dense_10x{doc_len}"] = dense * 1e3
        for method in METHODS:
            segments = prompts.prompt(0, method)[1]
            took = min(_ttft(engine, ids, segments) for _ in range(sizes.ttft_repeats))
            metrics[f"ttft_ms_{method}_10x{doc_len}"] = took * 1e3
            metrics[f"ttft_reduction_{method}_10x{doc_len}"] = 1 - took / dense
            rows.append((f"TTFT ms {method}, 10 x {doc_len} tokens", f"{took * 1e3:.0f}",
                         f"{dense * 1e3:.0f} (dense)", f"{took / dense:.3f}"))
    fidelity = _fidelity(engine, prompts, sizes)
    for method, results in fidelity.items():
        top1 = statistics.fmean(r.top1_agreement for r in results)
        kl = statistics.fmean(r.kl for r in results)
        greedy = statistics.fmean(float(r.greedy_match) for r in results)
        metrics.update({f"top1_agreement_{method}": top1, f"kl_{method}": kl, f"greedy_match_{method}": greedy})
        rows.append((f"fidelity {method} @ 10 x {sizes.doc_lens[-1]}: top1 / kl / greedy",
                     f"{top1:.3f} / {kl:.4f} / {greedy:.2f}", "1 / 0 / 1 (dense)", ""))
    return BenchResult("pic", metrics, {
        "model": engine.model_name,
        "quick": quick,
        "sizes": sizes.__dict__,
        "num_docs": NUM_DOCS,
        "reuse": dataclasses.asdict(reuse),
        "baseline": "dense prefill of the same token ids on the same engine",
        "documents": "cached beforehand, each prefilled alone; system prompt in the prefix cache",
        "ttft": f"best of {sizes.ttft_repeats} runs, max_tokens=1",
        "fidelity": f"mean over {sizes.num_questions} questions, {sizes.num_fidelity_tokens} tokens each",
    }, rows)
