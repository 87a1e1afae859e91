"""`kvrelay bench kvcomm`: KVCOMM's fully connected agents, scaled to SmolLM2 on a CPU.

Five agents answer a stream of questions in turn. Agent k's prompt, as in KVCOMM's
templates: its role prompt (fixed, in the prefix cache), the question (placeholder
`user_question`), a fixed instruction, then the answer of every agent before it
(placeholders `agent_j_current`), each followed by a fixed connecting line. Answers are
synthetic text of varying length about the question; each one's base KV is registered
the way the engine registers a real answer: computed right after its agent's prompt.

Side by side on every prompt of the stream:
- dense: a second engine with reuse off and nothing cached (the baseline);
- prefix: the prefix cache only (the role prompt hits);
- kvcomm: anchors learn from the first questions and predict later ones (the paper's
  `new_samples="predict"`; the engine's default serves answers from their first
  reader's KV instead, measured on the product path by `kvrelay bench agents --family long`).
TTFT per agent is the mean over the second half of the stream (warm pools). Fidelity
compares logits teacher-forced over the dense engine's greedy continuation; the
ablation rescoring the same prompts with rotation only / + placeholder offsets.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.common import BenchResult
from engine_ext.config import AnchorConfig, EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.fidelity import compare_logits
from engine_ext.model_store import resolve_model
from engine_ext.reuse.segments import ReuseScope, TokenSegment
from engine_ext.sampling import SamplingParams
from engine_ext.request import EngineRequest

ROLES = ("Knowledgeable Expert", "Critic", "Mathematician", "Psychologist", "Historian")
ABLATION = ("rotation", "placeholder", "full")
PAPER = AnchorConfig(new_samples="predict")


@dataclass(frozen=True)
class Sizes:
    num_agents: int
    num_questions: int
    role_tokens: int
    question_tokens: int  # the longest question; each is 75-100% of it
    answer_tokens: int  # the longest answer; each is 50-100% of it
    num_fidelity_tokens: int


QUICK = Sizes(num_agents=5, num_questions=4, role_tokens=64, question_tokens=96, answer_tokens=48,
              num_fidelity_tokens=8)
FULL = Sizes(num_agents=5, num_questions=20, role_tokens=256, question_tokens=384, answer_tokens=192,
             num_fidelity_tokens=16)

_TRADES = ("wool", "salt", "glass", "timber", "copper", "honey", "silk", "barley", "iron", "wine")
_SYLLABLES = ("vel", "mor", "an", "tis", "ka", "ren", "dor", "lu", "pha", "sen", "gri", "ost")


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(3)).capitalize()


class Workflow:
    """Token ids of every piece of every agent's prompt, each tokenized alone."""

    def __init__(self, engine: LLMEngine, sizes: Sizes, seed: int = 0) -> None:
        self.tok, self.sizes = engine.tokenizer, sizes
        rng = random.Random(seed)
        self.roles = [self._role(k, rng) for k in range(sizes.num_agents)]
        self.questions = [self._question(q, rng) for q in range(sizes.num_questions)]
        self.answers = [[self._answer(q, k, rng) for k in range(sizes.num_agents)] for q in range(sizes.num_questions)]
        self.tail = self.tok.encode("<|im_end|>\n<|im_start|>assistant\n")

    def _fit(self, text: str, num_tokens: int) -> list[int]:
        ids = self.tok.encode(text)
        if len(ids) < num_tokens:
            raise RuntimeError(f"text of {len(ids)} tokens is shorter than {num_tokens}")
        return ids[:num_tokens]

    def _role(self, k: int, rng: random.Random) -> list[int]:
        role = ROLES[k % len(ROLES)]
        duties = " ".join(f"Duty {i + 1}: as the {role.lower()}, weigh the {rng.choice(_TRADES)} records of "
                          f"{_name(rng)} with care and say plainly when the evidence is thin." for i in range(40))
        text = f"<|im_start|>system\nYou are the {role} of a panel of {self.sizes.num_agents} agents. {duties}"
        return self._fit(text, self.sizes.role_tokens) + self.tok.encode("<|im_end|>\n<|im_start|>user\n")

    def _question(self, q: int, rng: random.Random) -> list[int]:
        town = _name(rng)
        facts = " ".join(f"In {1700 + 5 * y} {town} traded {rng.choice(_TRADES)} with {_name(rng)} and its "
                         f"market grew by {rng.randrange(2, 30)} stalls." for y in range(60))
        n = rng.randrange(self.sizes.question_tokens * 3 // 4, self.sizes.question_tokens + 1)
        return self._fit(f"Question {q + 1}. The records of {town}: {facts}", n - 12) + \
            self.tok.encode(f" Which trade made {town} grow most?")[:12]

    def _answer(self, q: int, k: int, rng: random.Random) -> list[int]:
        steps = " ".join(f"Step {i + 1}: the {rng.choice(_TRADES)} trade added {rng.randrange(2, 30)} stalls "
                         f"in {1700 + 5 * rng.randrange(60)}, so it counts for {rng.randrange(1, 9)} points."
                         for i in range(40))
        n = rng.randrange(self.sizes.answer_tokens // 2, self.sizes.answer_tokens + 1)
        return self._fit(f"As the {ROLES[k % len(ROLES)].lower()}, I reason step by step. {steps}", n)

    def _connector(self, k: int, j: int) -> list[int]:
        """The fixed text after the question (j = -1) or after agent j's answer, in agent k's prompt."""
        nxt = (f"Now give your own answer as the {ROLES[k % len(ROLES)].lower()}, in a few short steps."
               if j + 1 == k else f"Agent {j + 2} of the panel answered as follows:")
        what = "the question" if j < 0 else f"the answer of agent {j + 1}"
        return self.tok.encode(f"\n\nThat was {what}. Weigh it against the records before you go on. {nxt}\n\n")

    def prompt(self, q: int, k: int) -> tuple[list[int], list[TokenSegment]]:
        """Agent k's prompt for question q, with its segments (the plan the gateway would send)."""
        ids = list(self.roles[k])
        segments = [TokenSegment(0, len(ids), "fixed_prefix", f"agent_{k + 1}")]
        pieces = [(self.questions[q], "user_question")] + \
            [(self.answers[q][j], f"agent_{j + 1}_current") for j in range(k)]
        for j, (text, name) in enumerate(pieces, start=-1):
            segments.append(TokenSegment(len(ids), len(ids) + len(text), "placeholder", name))
            ids += text
            connector = self._connector(k, j)
            segments.append(TokenSegment(len(ids), len(ids) + len(connector), "fixed_prefix", f"agent_{k + 1}"))
            ids += connector
        return ids + self.tail, segments


@dataclass
class Record:
    """One agent's turn on one question."""

    q: int
    k: int
    ttft: dict[str, float]  # method -> seconds
    num_placeholder_tokens: int
    num_predicted_tokens: int
    fidelity: dict[str, tuple[float, float]]  # ablation mode -> (top1, kl); empty when nothing was predicted


def first_token(engine: LLMEngine, ids, num_tokens: int = 1, segments=None, scope=None, continuation=None):
    """(TTFT seconds, seq): the request runs greedily to its first token, then on for
    `num_tokens` (teacher-forced when a continuation is given), recording logits."""
    sampling = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    seq = engine.add_request(EngineRequest(f"b{time.monotonic_ns()}", ids, sampling, segments=segments, publish=False, scope=scope))
    seq.logits = []
    if continuation:
        seq.forced_token_ids = list(continuation)
    start = time.perf_counter()
    while not seq.output_token_ids:
        engine.step()
    took = time.perf_counter() - start
    while not seq.is_finished:
        engine.step()
    return took, seq


def _turn(dense: LLMEngine, reuse: LLMEngine, wf: Workflow, q: int, k: int, evaluate: bool) -> Record:
    ids, segments = wf.prompt(q, k)
    scope = ReuseScope("bench", f"agent_{k + 1}")
    bank = reuse.anchor_bank
    n = wf.sizes.num_fidelity_tokens
    t_dense, reference = first_token(dense, ids, n)
    continuation, ref_logits = reference.output_token_ids, reference.logits
    t_kvcomm, seq = first_token(reuse, ids, n, segments, scope, continuation)
    t_prefix, exact = first_token(reuse, ids, n, continuation=continuation)
    outcomes = seq.reuse_outcomes or []
    placeholders = [o for o in outcomes if o.segment.kind == "placeholder"]
    predicted = sum(o.num_reused for o in placeholders if o.method == "kvcomm")
    fidelity: dict[str, tuple[float, float]] = {}
    if evaluate:
        fidelity["full"] = compare_logits(torch.stack(ref_logits), torch.stack(seq.logits))
        fidelity["exact"] = compare_logits(torch.stack(ref_logits), torch.stack(exact.logits))
        if predicted:
            served = bank.correction
            bank.learning = False  # the same decisions again, nothing learned or counted
            for mode in ("rotation", "placeholder"):
                bank.correction = mode
                scored = reuse.score(ids, continuation, segments, publish=False, scope=scope)
                fidelity[mode] = compare_logits(torch.stack(ref_logits), scored.logits)
            bank.correction, bank.learning = served, True
    register_answer(reuse, wf, q, k, scope)
    return Record(q, k, {"dense": t_dense, "prefix": t_prefix, "kvcomm": t_kvcomm},
                  sum(o.segment.num_tokens for o in placeholders), predicted, fidelity)


def register_answer(engine: LLMEngine, wf: Workflow, q: int, k: int, scope: ReuseScope) -> None:
    """Agent k's answer to question q, its base KV computed behind the agent's prompt as
    decoding would have, registered under its placeholder name."""
    ids = wf.prompt(q, k)[0]
    full = ids + wf.answers[q][k]
    engine.generate(full, SamplingParams(max_tokens=1), publish=False, scope=scope, segments=[
        TokenSegment(len(ids), len(full), "placeholder", f"agent_{k + 1}_current", "dense")])


ENGINE_BASE = {"kv_cache_bytes": 3072 * 2**20, "max_num_batched_tokens": 8192}


def kvcomm_engine(model: str | None) -> LLMEngine:
    """The embedded engine as this bench runs it: kvcomm for every planned segment."""
    return LLMEngine(resolve_model(model), EngineConfig(**ENGINE_BASE, reuse=ReuseConfig(default_method="kvcomm", anchors=PAPER)))


def _engines(model: str | None) -> tuple[LLMEngine, LLMEngine]:
    dense = LLMEngine(resolve_model(model),
                      EngineConfig(**ENGINE_BASE, reuse=ReuseConfig(enabled=False, default_method="dense")))
    return dense, kvcomm_engine(model)


def run(quick: bool, model: str | None) -> BenchResult:
    sizes = QUICK if quick else FULL
    dense, reuse = _engines(model)
    wf = Workflow(reuse, sizes)
    for role in wf.roles:  # role prompts into the kvcomm engine's prefix cache
        reuse.generate(role, SamplingParams(max_tokens=1))
    warm = sizes.num_questions // 2
    records = [_turn(dense, reuse, wf, q, k, evaluate=q >= warm)
               for q in range(sizes.num_questions) for k in range(sizes.num_agents)]
    return _result(records, sizes, reuse, quick, warm)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _result(records: list[Record], sizes: Sizes, reuse: LLMEngine, quick: bool, warm: int) -> BenchResult:
    metrics: dict[str, float] = {}
    rows: list[tuple[str, str, str, str]] = []
    late = [r for r in records if r.q >= warm]
    for k in range(sizes.num_agents):
        mine = [r for r in late if r.k == k]
        means = {m: _mean([r.ttft[m] for r in mine]) for m in ("dense", "prefix", "kvcomm")}
        for method, value in means.items():
            metrics[f"ttft_ms_{method}_agent{k + 1}"] = value * 1e3
        metrics[f"speedup_agent{k + 1}"] = means["dense"] / means["kvcomm"]
        metrics[f"speedup_prefix_agent{k + 1}"] = means["dense"] / means["prefix"]
        rows.append((f"TTFT ms agent {k + 1}: kvcomm (prefix only)",
                     f"{means['kvcomm'] * 1e3:.0f} ({means['prefix'] * 1e3:.0f})",
                     f"{means['dense'] * 1e3:.0f} (dense)", f"{means['kvcomm'] / means['dense']:.3f}"))
    metrics["agent5_ttft_speedup"] = metrics[f"speedup_agent{sizes.num_agents}"]
    total = sum(r.num_placeholder_tokens for r in records)
    metrics["reuse_rate"] = sum(r.num_predicted_tokens for r in records) / total
    metrics["reuse_rate_warm"] = sum(r.num_predicted_tokens for r in late) / sum(r.num_placeholder_tokens for r in late)
    rows.append(("reuse rate (placeholder tokens predicted), all / warm half",
                 f"{metrics['reuse_rate']:.3f} / {metrics['reuse_rate_warm']:.3f}", "0 (dense)", ""))
    served = [r.fidelity["full"] for r in late]
    metrics["top1_agreement"] = _mean([t for t, _ in served])
    metrics["kl"] = _mean([kl for _, kl in served])
    rows.append(("fidelity, every warm request: top1 / kl", f"{metrics['top1_agreement']:.3f} / {metrics['kl']:.4f}",
                 "1 / 0 (dense)", ""))
    exact = [r.fidelity["exact"] for r in late]  # the default: the prefix cache only
    metrics["top1_agreement_exact"] = _mean([t for t, _ in exact])
    metrics["kl_exact"] = _mean([kl for _, kl in exact])
    rows.append(("fidelity of the exact default (prefix only): top1 / kl",
                 f"{metrics['top1_agreement_exact']:.3f} / {metrics['kl_exact']:.4f}", "1 / 0 (dense)", ""))
    predicted = [r for r in late if "rotation" in r.fidelity]
    for mode in ABLATION:
        top1 = _mean([r.fidelity[mode][0] for r in predicted])
        kl = _mean([r.fidelity[mode][1] for r in predicted])
        metrics[f"top1_agreement_{mode}"], metrics[f"kl_{mode}"] = top1, kl
        rows.append((f"ablation on {len(predicted)} predicted requests, {mode}: top1 / kl",
                     f"{top1:.3f} / {kl:.4f}", "1 / 0 (dense)", ""))
    metrics["kl_ratio_vs_shift"] = metrics["kl_full"] / metrics["kl_rotation"] if predicted else float("nan")
    stats = reuse.anchor_bank.stats()
    metrics["anchors"] = stats["anchors"]
    metrics["anchor_mib"] = stats["anchor_bytes"] / 2**20
    return BenchResult("kvcomm", metrics, {
        "model": reuse.model_name, "quick": quick, "sizes": dataclasses.asdict(sizes),
        "anchors": dataclasses.asdict(PAPER),
        "baseline": "dense: a second engine with reuse off and nothing cached; prefix: the prefix cache only",
        "ttft": f"mean over questions {warm + 1}..{sizes.num_questions} (warm pools), max one forced token",
        "fidelity": f"teacher-forced over {sizes.num_fidelity_tokens} dense greedy tokens, warm half",
        "answers": "synthetic text; base KV computed behind the producing agent's prompt",
    }, rows)
