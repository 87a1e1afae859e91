"""`kvrelay bench collective`: TokenDance's All-Gather round, scaled to SmolLM2 on a CPU.

A Generative-Agents-like town: each agent has a private history (persona and memories,
its system prompt, in the prefix cache since its last turn). In round 1 every agent said
something; those outputs are registered the way the engine registers a real answer
(computed right after the agent's own prompt). In round 2 every agent reads all round-1
outputs, each agent in its own order, then the task. Per agent count n, side by side:

- per-request: the round's prompts, each reused on its own (shift + CacheBlend's
  recompute of ceil(r * n_i) tokens per segment, selected by its own deviation pass);
- collective: the same prompts as one round group (one batched shift, one deviation
  pass, the same number of recomputed tokens, one batched recovery).
Round prefill time is the wall time until every agent has its first token (best of a
few paired runs). At the largest n, the round's caches go to the DiffStore: mirror
bytes over dense bytes, dense bytes over master + mirrors, fused vs dense restore time
(bit-exactness checked against the members' own KV), and fidelity (top1 / KL over the
dense greedy continuation) of collective and per-request reuse. Last, agents' next turn
(their round-2 prompt, answer and a new line): TTFT restored from the stored round vs
the same plan reused per request.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.common import BenchResult, paired_best_of
from engine_ext.config import CollectiveConfig, EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.fidelity import compare_logits
from engine_ext.model_store import resolve_model
from kvrelay.wire.plan import RoundInfo
from engine_ext.reuse.segments import ReuseScope, TokenSegment
from engine_ext.sampling import SamplingParams
from engine_ext.sequence import Sequence
from engine_ext.request import EngineRequest

NAMES = ("Isabella", "Klaus", "Maria", "Sam", "Ayesha", "Tom", "Carmen", "Wolfgang", "Jennifer", "Yuriko")
_PLACES = ("the cafe", "the library", "the park", "the pharmacy", "the college", "the market", "the bar")
_DEEDS = ("painted a mural", "read about chemistry", "planned a party", "fixed a bicycle", "wrote a poem",
          "argued about the election", "baked bread", "practised the piano")


@dataclass(frozen=True)
class Sizes:
    agent_counts: tuple[int, ...]
    history_tokens: int
    output_tokens: int  # the longest round-1 output; each is 50-100% of it
    repeats: int
    fidelity_agents: int  # agents of the largest round whose fidelity is measured
    num_fidelity_tokens: int
    next_turn_agents: int  # agents whose next turn (restored from the stored round) is timed


QUICK = Sizes(agent_counts=(3, 10), history_tokens=96, output_tokens=48, repeats=1, fidelity_agents=2,
              num_fidelity_tokens=4, next_turn_agents=2)
FULL = Sizes(agent_counts=(3, 5, 10), history_tokens=256, output_tokens=128, repeats=3, fidelity_agents=10,
             num_fidelity_tokens=16, next_turn_agents=5)


class Town:
    """Token ids of every agent's history, round-1 prompt and output, and round-2 prompt."""

    def __init__(self, engine: LLMEngine, sizes: Sizes, num_agents: int, seed: int = 0) -> None:
        self.tok, self.n = engine.tokenizer, num_agents
        rng = random.Random(seed)
        self.histories = [self._history(i, sizes.history_tokens, rng) for i in range(num_agents)]
        self.round1 = self.tok.encode("<|im_start|>user\nRound 1: say what you did this morning.<|im_end|>\n"
                                      "<|im_start|>assistant\n")
        self.outputs = [self._output(i, rng.randrange(sizes.output_tokens // 2, sizes.output_tokens + 1), rng)
                        for i in range(num_agents)]
        self.opening = self.tok.encode("<|im_start|>user\nRound 2. What everyone said in round 1:\n")
        self.labels = [self.tok.encode(f"\n{NAMES[j % len(NAMES)]}: ") for j in range(num_agents)]

    def _fit(self, text: str, num_tokens: int) -> list[int]:
        ids = self.tok.encode(text)
        if len(ids) < num_tokens:
            raise RuntimeError(f"text of {len(ids)} tokens is shorter than {num_tokens}")
        return ids[:num_tokens]

    def _history(self, i: int, num_tokens: int, rng: random.Random) -> list[int]:
        name = NAMES[i % len(NAMES)]
        memories = " ".join(f"Memory {k + 1}: on day {k + 1} {name} {rng.choice(_DEEDS)} at {rng.choice(_PLACES)} "
                            f"with {rng.choice(NAMES)}." for k in range(60))
        text = f"<|im_start|>system\nYou are {name}, who lives in Smallville. {memories}"
        return self._fit(text, num_tokens) + self.tok.encode("<|im_end|>\n")

    def _output(self, i: int, num_tokens: int, rng: random.Random) -> list[int]:
        deeds = " ".join(f"Then I went to {rng.choice(_PLACES)} and {rng.choice(_DEEDS)} with {rng.choice(NAMES)}."
                         for _ in range(40))
        return self._fit(f"This morning I, {NAMES[i % len(NAMES)]}, woke early. {deeds}", num_tokens)

    def round1_prompt(self, i: int) -> list[int]:
        return self.histories[i] + self.round1

    def prompt(self, i: int) -> tuple[list[int], list[TokenSegment]]:
        """Agent i's round-2 prompt and its plan: every round-1 output as a placeholder."""
        ids, segments = self.histories[i] + self.opening, []
        for j in random.Random(1000 + i).sample(range(self.n), self.n):  # each agent reads in its own order
            ids += self.labels[j]
            segments.append(TokenSegment(len(ids), len(ids) + len(self.outputs[j]), "placeholder",
                                         f"agent_{j + 1}_current", "blend", j))
            ids += self.outputs[j]
        name = NAMES[i % len(NAMES)]
        return ids + self.tok.encode(f"\nWhat does {name} do next? Answer in one sentence.<|im_end|>\n"
                                     "<|im_start|>assistant\n"), segments

    def prepare(self, engine: LLMEngine) -> None:
        """Histories into the prefix cache; each output registered behind its agent's prompt."""
        for i in range(self.n):
            prompt = self.round1_prompt(i)
            full = prompt + self.outputs[i]
            engine.generate(full, SamplingParams(max_tokens=1), scope=ReuseScope("town", f"agent_{i + 1}"),
                            segments=[TokenSegment(len(prompt), len(full), "placeholder", f"agent_{i + 1}_current",
                                                   "blend")])  # blend: opted in, so the output is kept


def _add_round(engine: LLMEngine, town: Town, round_id: str | None, max_tokens: int = 1,
               agents: range | None = None, publish: bool = False, method: str | None = None) -> list[Sequence]:
    """The round's requests, queued; `method` replaces the plan's (blend) on every segment."""
    seqs = []
    agents = range(town.n) if agents is None else agents
    for i in agents:
        ids, segments = town.prompt(i)
        if method is not None:
            segments = [seg._replace(method=method) for seg in segments]
        info = RoundInfo(id=round_id, size=len(agents), index=i) if round_id else None
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seqs.append(engine.add_request(EngineRequest(f"{round_id}-{i}-{time.monotonic_ns()}", ids, sampling, segments=segments,
                                       scope=ReuseScope("town", f"agent_{i + 1}", info), publish=publish)))
    return seqs


def _prefill_round(engine: LLMEngine, town: Town, round_id: str | None) -> list[Sequence]:
    seqs = _add_round(engine, town, round_id)
    while engine.has_work:
        engine.step()
    missed = [o for s in seqs for o in s.reuse_outcomes or [] if o.method != "blend"]
    if missed:
        raise RuntimeError(f"{len(missed)} outputs were not reused as planned ({missed[0].reason}); "
                           "raise the KV budget")
    return seqs


class RoundRunner:
    """Runs round 2 of a town on one engine, per request or as one collective group."""

    def __init__(self, engine: LLMEngine, town: Town, publish: bool = False) -> None:
        self.engine, self.town, self.publish = engine, town, publish  # publish: the round's caches are stored
        self.num_rounds = 0
        self.recompute_ratio: dict[str, float] = {}  # path -> recomputed / placed tokens, latest round

    def per_request(self) -> list[Sequence]:
        seqs = _prefill_round(self.engine, self.town, None)
        self.recompute_ratio["per_request"] = _recompute_ratio(seqs)
        return seqs

    def collective(self, max_tokens: int = 1) -> list[Sequence]:
        self.num_rounds += 1
        grouped = self.engine.collector.num_grouped
        seqs = _add_round(self.engine, self.town, f"round-{self.num_rounds}", max_tokens, publish=self.publish)
        while self.engine.has_work and any(not s.output_token_ids for s in seqs):
            self.engine.step()
        if self.engine.collector.num_grouped - grouped != len(seqs):
            raise RuntimeError("the round did not run as one collective group")
        self.recompute_ratio["collective"] = _recompute_ratio(seqs)
        return seqs


def _recompute_ratio(seqs: list[Sequence]) -> float:
    outcomes = [o for s in seqs for o in s.reuse_outcomes or [] if o.method == "blend"]
    return sum(o.num_recomputed for o in outcomes) / max(sum(o.segment.num_tokens for o in outcomes), 1)


def _engine(model: str | None, diff_store: bool) -> LLMEngine:
    reuse = ReuseConfig(collective=CollectiveConfig(diff_store=diff_store))
    return LLMEngine(resolve_model(model), EngineConfig(kv_cache_bytes=4096 * 2**20, max_num_batched_tokens=8192,
                                                        reuse=reuse))


def _kv(engine: LLMEngine, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.index_select(0, slots).clone(), v.index_select(0, slots).clone()) for k, v in engine.kv_cache.layers]


def _storage(engine: LLMEngine, town: Town, repeats: int) -> tuple[dict[str, float], list[Sequence]]:
    """One collective round into the DiffStore: sizes, and restore of every mirror,
    checked bit for bit. Returns the metrics and the round's (finished) requests."""
    store = engine.diff_store
    seqs = RoundRunner(engine, town, publish=True).collective(max_tokens=2)  # still running: KV readable
    result = store.last_round
    snapshots = {s.request_id: _kv(engine, engine.kv.slots(s, s.num_prompt_tokens)) for s in seqs}
    fused, dense, exact = [], [], True
    for seq in seqs:
        view = store.read(seq.prompt_token_ids)
        if view is None:
            raise RuntimeError("a member of the round was not stored; raise the KV budget")
        n = view.num_tokens - view.region_start
        blocks = engine.kv.pool.allocate(engine.kv.num_blocks_for(n))
        ids = torch.tensor([b.block_id for b in blocks])
        dst = (ids[:, None] * engine.kv.block_size + torch.arange(engine.kv.block_size)).flatten()[:n]
        t_fused, t_dense = paired_best_of(lambda: view.restore(engine.kv_cache.layers, dst),
                                          lambda: view.restore_dense(engine.kv_cache.layers, dst), repeats + 2)
        view.restore(engine.kv_cache.layers, dst)
        restored = _kv(engine, dst)
        expected = [(k[view.region_start:], v[view.region_start:]) for k, v in snapshots[seq.request_id]]
        exact &= all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(restored, expected))
        engine.kv.pool.release(blocks)
        if type(view).__name__ == "MirrorView":
            fused.append(t_fused)
            dense.append(t_dense)
    while engine.has_work:
        engine.step()
    mirrors = [(b, d) for b, d in zip(result.mirror_bytes, result.dense_bytes) if b is not None]
    return seqs, {
        "mirror_fraction": statistics.fmean(b / d for b, d in mirrors),
        "round_storage_reduction": sum(result.dense_bytes) / result.num_stored_bytes,
        "dense_mib": sum(result.dense_bytes) / 2**20,
        "stored_mib": result.num_stored_bytes / 2**20,
        "master_mib": result.master_bytes / 2**20,
        "restore_ms_fused": statistics.fmean(fused) * 1e3,
        "restore_ms_dense": statistics.fmean(dense) * 1e3,
        "restore_bit_exact": float(exact),
        "store_ms": result.seconds * 1e3,
    }


def _next_turn(storing: LLMEngine, timing: LLMEngine, town: Town, seqs: list[Sequence], agents: int,
               repeats: int) -> dict[str, float]:
    """TTFT of agents' next turn (round-2 prompt, its answer, a new line): restored from
    the stored round on one engine, the same plan reused per request on the other."""
    tail = town.tok.encode("\nThe town hall bell rings. What now?")
    restored, per_request = [], []
    for i, seq in enumerate(seqs[:agents]):
        ids, segments = seq.token_ids + tail, town.prompt(i)[1]

        def first_token(engine: LLMEngine) -> Sequence:
            return engine.generate(ids, SamplingParams(max_tokens=1), segments=segments, publish=False)

        t_restored, t_blend = paired_best_of(lambda: first_token(storing), lambda: first_token(timing), repeats)
        if not any(o.method == "restored" for o in first_token(storing).reuse_outcomes or []):
            raise RuntimeError("the next turn was not restored from the stored round; raise the KV budget")
        restored.append(t_restored)
        per_request.append(t_blend)
    return {"next_turn_ttft_ms_restored": statistics.fmean(restored) * 1e3,
            "next_turn_ttft_ms_per_request": statistics.fmean(per_request) * 1e3,
            "next_turn_speedup": statistics.fmean(per_request) / statistics.fmean(restored)}


def _fidelity(engine: LLMEngine, town: Town, agents: int, num_tokens: int) -> dict[str, float]:
    """top1 / KL of collective and per-request reuse, and of the exact default (the
    prefix cache only), against dense, teacher-forced."""
    references = []
    for i in range(agents):
        ids, _ = town.prompt(i)
        ref = engine.generate(ids, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True),
                              publish=False, record_logits=True)
        references.append((ref.output_token_ids, torch.stack(ref.logits)))
    scores: dict[str, list[tuple[float, float]]] = {"collective": [], "per_request": [], "exact": []}
    for path in scores:
        round_id = f"fidelity-{path}" if path == "collective" else None
        seqs = _add_round(engine, town, round_id, num_tokens, range(town.n), method="prefix" if path == "exact" else None)
        for i, seq in enumerate(seqs):
            seq.logits = []
            seq.forced_token_ids = list(references[i][0]) if i < agents else None
        while engine.has_work:
            engine.step()
        scores[path] = [compare_logits(references[i][1], torch.stack(seqs[i].logits)) for i in range(agents)]
    suffix = {"collective": "", "per_request": "_per_request", "exact": "_exact"}
    return {f"{m}{suffix[path]}": statistics.fmean(v[k] for v in vals)
            for path, vals in scores.items() for k, m in enumerate(("top1_agreement", "kl"))}


def run(quick: bool, model: str | None) -> BenchResult:
    sizes = QUICK if quick else FULL
    timing = _engine(model, diff_store=False)
    rows: list[tuple[str, str, str, str]] = []
    metrics: dict[str, float] = {}
    for n in sizes.agent_counts:
        town = Town(timing, sizes, n)
        town.prepare(timing)
        runner = RoundRunner(timing, town)
        t_coll, t_single = paired_best_of(runner.collective, runner.per_request, sizes.repeats)
        metrics[f"round_ms_per_request_{n}"] = t_single * 1e3
        metrics[f"round_ms_collective_{n}"] = t_coll * 1e3
        metrics[f"collective_speedup_{n}"] = t_single / t_coll
        for path, ratio in runner.recompute_ratio.items():
            metrics[f"recompute_ratio_{path}_{n}"] = ratio
        rows.append((f"round prefill ms, {n} agents", f"{t_coll * 1e3:.0f}", f"{t_single * 1e3:.0f} (per-request)",
                     f"{t_coll / t_single:.3f}"))
    largest = sizes.agent_counts[-1]
    storing = _engine(model, diff_store=True)
    town = Town(storing, sizes, largest)
    town.prepare(storing)
    seqs, storage = _storage(storing, town, sizes.repeats)
    metrics.update(storage)
    rows += [
        (f"KV bytes of the {largest}-agent round (MiB)", f"{storage['stored_mib']:.1f} (master + mirrors)",
         f"{storage['dense_mib']:.1f} (dense)", f"{1 / storage['round_storage_reduction']:.3f}"),
        ("mirror bytes / dense bytes, mean", f"{storage['mirror_fraction']:.3f}", "1 (dense)", ""),
        ("ms to store the round (master + mirrors)", f"{storage['store_ms']:.0f}", "", ""),
        ("restore ms per mirror, bit-exact" if storage["restore_bit_exact"] else "restore ms per mirror, NOT EXACT",
         f"{storage['restore_ms_fused']:.1f} (fused)", f"{storage['restore_ms_dense']:.1f} (dense restore)",
         f"{storage['restore_ms_fused'] / storage['restore_ms_dense']:.3f}"),
    ]
    turn = _next_turn(storing, timing, town, seqs, min(sizes.next_turn_agents, largest), sizes.repeats)
    metrics.update(turn)
    rows.append((f"next-turn TTFT ms ({min(sizes.next_turn_agents, largest)} agents; prompt extends the round's)",
                 f"{turn['next_turn_ttft_ms_restored']:.0f} (restored)",
                 f"{turn['next_turn_ttft_ms_per_request']:.0f} (per-request blend)",
                 f"{1 / turn['next_turn_speedup']:.3f}"))
    fidelity = _fidelity(timing, Town(timing, sizes, largest), min(sizes.fidelity_agents, largest),
                         sizes.num_fidelity_tokens)
    metrics.update(fidelity)
    rows.append((f"fidelity vs dense, {largest} agents: top1 / kl",
                 f"{fidelity['top1_agreement']:.3f} / {fidelity['kl']:.4f}",
                 f"{fidelity['top1_agreement_per_request']:.3f} / {fidelity['kl_per_request']:.4f} (per-request)", ""))
    rows.append((f"fidelity of the exact default (prefix only), {largest} agents: top1 / kl",
                 f"{fidelity['top1_agreement_exact']:.3f} / {fidelity['kl_exact']:.4f}", "1 / 0 (dense)", ""))
    metrics["fused_restore_speedup"] = storage["restore_ms_dense"] / storage["restore_ms_fused"]
    metrics["round_storage_reduction_" + str(largest)] = metrics.pop("round_storage_reduction")
    return BenchResult("collective", metrics, {
        "model": timing.model_name, "quick": quick, "sizes": dataclasses.asdict(sizes),
        "reuse": dataclasses.asdict(timing.config.reuse),
        "baseline": "per-request: the same prompts without a round id, each reused alone (blend, same ratio)",
        "round_time": f"wall time until every agent has its first token, best of {sizes.repeats} paired runs",
        "storage": "region beyond the prefix cache; dense = each member's region in pool blocks",
        "fidelity": f"teacher-forced over {sizes.num_fidelity_tokens} dense greedy tokens, "
                    f"{min(sizes.fidelity_agents, largest)} agents",
    }, rows)
