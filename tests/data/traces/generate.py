"""Labelled multi-agent traces for the inference suite (tests/gateway/inference/test_trace_suite.py).

Each trace is one JSONL file: a header record (trace name, what it exercises, the true
step-graph edges per app), then one record per request in the order a gateway would see
them. Every label is written from how this script BUILT the prompt: when it quotes an
earlier output, tool result or the user question, it knows the exact span it inserted and
whose text it is. Nothing here runs the gateway's inference, so the labels can judge it.

Agents' answers come from the embedded engine running SmolLM2-135M-Instruct on CPU
(`--outputs model`, the default, cached in model_outputs.json so reruns need no model),
or from varied hand-written templates (`--outputs template`). A greedy answer that is too
short to be matched (32 chars), or equal to a text the app already has (small models copy
earlier answers verbatim, or pieces of their own prompt), would make the true label
ambiguous: it is retried with seeded sampling, and only then replaced by the template answer.

    .venv/bin/python tests/data/traces/generate.py                    # model outputs (cached)
    .venv/bin/python tests/data/traces/generate.py --outputs template --out /tmp/traces
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import random
import sys
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from engine_ext.request import EngineRequest

HERE = Path(__file__).resolve().parent
CACHE_FILE = HERE / "model_outputs.json"
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 48  # short answers: the whole suite must generate in a few CPU minutes
MIN_OUTPUT_CHARS = 40  # comfortably above the gateway's 32-char anchor
MAX_FALLBACKS = 8
OutputMode = Literal["model", "template"]

# --------------------------------------------------------------------------------------
# Construction: prompts built piece by piece, so every quoted span is known exactly.
# --------------------------------------------------------------------------------------

RefKind = Literal["output", "tool", "question"]


@dataclass(frozen=True)
class Ref:
    """Which earlier text of the session a quote reproduces."""

    kind: RefKind
    key: str  # output: the producing request's key; tool: the tool result's key; question: "q"


QUESTION = Ref("question", "q")


@dataclass(frozen=True)
class Said:
    """An answer some request of the session produced, as the session code sees it."""

    key: str
    agent: str
    text: str

    @property
    def ref(self) -> Ref:
        return Ref("output", self.key)


@dataclass(frozen=True)
class Quote:
    message_index: int
    start: int
    end: int
    ref: Ref


class Content:
    """One message's content, concatenated from plain text and quoted texts."""

    def __init__(self, index: int, quotes: list[Quote]) -> None:
        self._index = index
        self._quotes = quotes
        self._parts: list[str] = []
        self._length = 0

    def text(self, text: str) -> Content:
        self._parts.append(text)
        self._length += len(text)
        return self

    def quote(self, text: str, ref: Ref) -> Content:
        self._quotes.append(Quote(self._index, self._length, self._length + len(text), ref))
        return self.text(text)

    def said(self, said: Said) -> Content:
        return self.quote(said.text, said.ref)

    def value(self) -> str:
        return "".join(self._parts)


@dataclass
class Draft:
    """A request before its answer exists."""

    agent: str
    messages: list[dict[str, Any]]
    quotes: list[Quote]
    fallbacks: list[str]  # template answers, first unused one wins
    round: str | None = None
    fixed: str | None = None  # an answer no model writes (a speaker name picked by the framework)
    extra_body: dict[str, Any] = field(default_factory=dict)


class Prompt:
    """The messages of one request; `draft()` freezes their contents."""

    def __init__(self) -> None:
        self._messages: list[tuple[dict[str, Any], Content]] = []
        self._quotes: list[Quote] = []

    def add(self, role: str, **fields: Any) -> Content:
        content = Content(len(self._messages), self._quotes)
        self._messages.append(({"role": role, **fields}, content))
        return content

    def draft(self, agent: str, fallbacks: Sequence[str], round_label: str | None = None,
              fixed: str | None = None, **extra_body: Any) -> Draft:
        messages = []
        for message, content in self._messages:
            ordered = {"role": message["role"]}
            if "name" in message:
                ordered["name"] = message["name"]
            ordered["content"] = content.value()
            ordered.update({k: v for k, v in message.items() if k not in ("role", "name")})
            messages.append(ordered)
        return Draft(agent, messages, list(self._quotes), list(fallbacks), round_label, fixed, dict(extra_body))


SessionRun = Generator[list[Draft], list[Said], None]


@dataclass
class SessionSpec:
    trace: str
    app: str
    label: str  # the true session id
    run: Callable[[random.Random], SessionRun]
    headers: dict[str, str] = field(default_factory=dict)
    start_wave: int = 0  # sessions start staggered, as concurrent users do


@dataclass
class TraceSpec:
    name: str
    description: str
    sessions: list[SessionSpec]


@dataclass
class Record:
    """A request with its answer, in the order the gateway sees it."""

    spec: SessionSpec
    draft: Draft
    key: str
    response: str
    origin: str  # model | template | fixed
    wave: int  # the step it was sent in: a session's requests of one wave run at the same time


# --------------------------------------------------------------------------------------
# Answers: the embedded engine (cached) or the drafts' template answers.
# --------------------------------------------------------------------------------------


SAMPLED_ATTEMPTS = (0.8, 1.0)  # temperatures of the retries after a greedy answer that cannot be used


def cache_key(messages: list[dict[str, Any]], attempt: int = 0) -> str:
    """Only what the model sees: roles and contents (names and tool calls are not rendered)."""
    seen = [[m["role"], m.get("content") or ""] for m in messages]
    spec: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "greedy": True, "messages": seen}
    if attempt:
        spec.update(greedy=False, attempt=attempt, temperature=SAMPLED_ATTEMPTS[attempt - 1])
    blob = json.dumps(spec, ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class ModelAnswers:
    """Answers of SmolLM2-135M-Instruct (greedy, or seeded samples for retries), batched
    per wave and remembered by prompt, so a rerun never needs the model."""

    def __init__(self, cache_only: bool) -> None:
        self.cache_only = cache_only
        self.cache: dict[str, str] = json.loads(CACHE_FILE.read_text()) if CACHE_FILE.exists() else {}
        self.used: dict[str, str] = {}
        self.generated = 0
        self._engine: Any = None
        self._unavailable = False

    def answers(self, drafts: list[Draft], attempt: int = 0) -> list[str | None]:
        """One answer per draft; None where no model answer can be had."""
        keys = [cache_key(d.messages, attempt) for d in drafts]
        missing = {k: d.messages for k, d in zip(keys, drafts) if k not in self.cache}
        if missing:
            if self.cache_only:
                raise LookupError(f"{len(missing)} model answers are not cached; run without --cache-only")
            self._generate(dict(sorted(missing.items())), attempt)
        out: list[str | None] = []
        for key in keys:
            text = self.cache.get(key)
            if text is not None:
                self.used[key] = text
            out.append(text)
        return out

    def _generate(self, prompts: dict[str, list[dict[str, Any]]], attempt: int) -> None:
        engine = self._load()
        if engine is None:
            return
        from engine_ext.sampling import SamplingParams

        running = {}
        for key, messages in prompts.items():
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0) if not attempt else SamplingParams(
                max_tokens=MAX_TOKENS, temperature=SAMPLED_ATTEMPTS[attempt - 1], top_p=0.95, seed=int(key[:8], 16))
            rendered = engine.tokenizer.render_chat([{"role": m["role"], "content": m.get("content") or ""}
                                                     for m in messages])
            running[key] = engine.add_request(EngineRequest(key, engine.tokenizer.encode(rendered), params))
        while any(not seq.is_finished for seq in running.values()):
            engine.step()
        for key, seq in running.items():
            self.cache[key] = seq.detokenizer.text.strip()
        self.generated += len(running)
        print(f"  generated {len(running)} answers ({self.generated} so far)", file=sys.stderr)

    def _load(self) -> Any:
        """The engine, or None (once, with a warning) when the model cannot be had."""
        if self._engine is None and not self._unavailable:
            try:
                from engine_ext.config import EngineConfig
                from engine_ext.engine import LLMEngine
                from engine_ext.model_store import prepare_default_model

                config = EngineConfig(kv_cache_bytes=2 * 2**30, max_num_seqs=128, max_num_batched_tokens=4096,
                                      num_threads=2)
                self._engine = LLMEngine(prepare_default_model(progress=False), config, model_name=MODEL)
            except Exception as exc:  # no package, no weights: fall back to templates, loudly
                print(f"warning: model unavailable ({exc}); using template answers", file=sys.stderr)
                self._unavailable = True
        return self._engine

    def save(self) -> None:
        """Keep only the answers this run used, so the committed cache stays small."""
        if self.generated or set(self.used) != set(self.cache):
            CACHE_FILE.write_text(json.dumps(dict(sorted(self.used.items())), ensure_ascii=False, indent=0) + "\n")


class Answerer:
    """Picks each request's answer and keeps every answer distinct within its app.

    Small models often repeat an earlier agent's answer word for word; such a copy (or an
    answer too short to be matched) would leave the true label ambiguous. Those requests
    get seeded sampled answers from the model instead, and the template answer only when
    every attempt fails."""

    def __init__(self, mode: OutputMode, cache_only: bool) -> None:
        self.model = ModelAnswers(cache_only) if mode == "model" else None
        self.taken: dict[tuple[str, str], set[str]] = {}  # (trace, app) -> texts the app has seen

    def answer(self, wave: list[tuple[SessionSpec, Draft]]) -> list[tuple[str, str]]:
        for spec, draft in wave:
            self._remember_quotes(spec, draft)
        chosen: list[tuple[str, str] | None] = [(d.fixed, "fixed") if d.fixed is not None else None for _, d in wave]
        if self.model is not None:
            todo = [i for i, c in enumerate(chosen) if c is None]
            for attempt in range(len(SAMPLED_ATTEMPTS) + 1):
                texts = self.model.answers([wave[i][1] for i in todo], attempt)
                origin = "model" if attempt == 0 else "model-sampled"
                for i, text in zip(todo, texts):
                    taken = self.taken.setdefault((wave[i][0].trace, wave[i][0].app), set())
                    if text is not None and usable(text, taken) and not parrots(text, wave[i][1]):
                        taken.add(text)
                        chosen[i] = (text, origin)
                todo = [i for i in todo if chosen[i] is None]
                if not todo:
                    break
        return [c if c is not None else self._template(spec, draft) for (spec, draft), c in zip(wave, chosen)]

    def _template(self, spec: SessionSpec, draft: Draft) -> tuple[str, str]:
        taken = self.taken.setdefault((spec.trace, spec.app), set())
        for fallback in draft.fallbacks:
            if usable(fallback, taken):
                taken.add(fallback)
                return fallback, "template"
        raise ValueError(f"{spec.trace}/{spec.label}: every template answer of {draft.agent} is taken")

    def _remember_quotes(self, spec: SessionSpec, draft: Draft) -> None:
        """Questions and tool results count as taken too: an answer equal to one is ambiguous."""
        taken = self.taken.setdefault((spec.trace, spec.app), set())
        for quote in draft.quotes:
            if quote.ref.kind != "output":
                taken.add(draft.messages[quote.message_index]["content"][quote.start:quote.end])


def usable(text: str, taken: set[str]) -> bool:
    return len(text) >= MIN_OUTPUT_CHARS and text == text.strip() and text not in taken and "<TTSEP>" not in text


def parrots(text: str, draft: Draft) -> bool:
    """An answer copied verbatim out of its own prompt (say, a speaker label plus the start
    of an earlier answer) reappears inside later prompts overlapping the text they really
    quote, so which one a span stands for would be a coin toss."""
    return any(text in (m.get("content") or "") for m in draft.messages)


# --------------------------------------------------------------------------------------
# Running the sessions: all traces in lockstep waves, so one model batch serves many.
# --------------------------------------------------------------------------------------


@dataclass
class _Live:
    spec: SessionSpec
    run: SessionRun
    pending: list[Draft]
    num_answers: int = 0


def drive(traces: list[TraceSpec], answerer: Answerer) -> dict[str, list[Record]]:
    """Run every session; returns each trace's records in the order they were sent."""
    order = random.Random("interleave")
    waiting = [s for t in traces for s in t.sessions]
    live: list[_Live] = []
    records: dict[str, list[Record]] = {t.name: [] for t in traces}
    wave = 0
    while waiting or live:
        for spec in [s for s in waiting if s.start_wave <= wave]:
            waiting.remove(spec)
            run = spec.run(random.Random(f"{spec.trace}/{spec.app}/{spec.label}"))
            live.append(_Live(spec, run, next(run)))
        order.shuffle(live)
        batch = [(item.spec, draft) for item in live for draft in item.pending]
        answers = iter(answerer.answer(batch)) if batch else iter(())
        for item in list(live):
            said = []
            for draft in item.pending:
                text, origin = next(answers)
                key = f"r{item.num_answers}"
                item.num_answers += 1
                records[item.spec.trace].append(Record(item.spec, draft, key, text, origin, wave))
                said.append(Said(key, draft.agent, text))
            try:
                item.pending = item.run.send(said)
            except StopIteration:
                live.remove(item)
        wave += 1
    return records


# --------------------------------------------------------------------------------------
# Labels: names by the KVCOMM convention, from what each prompt was built with.
# --------------------------------------------------------------------------------------


# A tool message on the request that first carries it is a placeholder there too, like
# the question on the session's first request: it is a variable part of the agent's
# prompt (KVCOMM's condition), planned as what it will be so the engine can keep its KV
# for the requests that quote it again. Flip this to label only re-quoted tool results.
FIRST_TOOL_IS_PLACEHOLDER = True


@dataclass
class _SessionTexts:
    """The session's texts in the order it came to know them: the question and new tool
    results when a request first carries them, an answer when it is given."""

    clock: int = 0
    time: dict[Ref, int] = field(default_factory=dict)
    owner: dict[Ref, str] = field(default_factory=dict)  # producing agent, or the agent that received a tool result
    series: dict[tuple[RefKind, str], list[Ref]] = field(default_factory=dict)  # (kind, agent) -> refs, oldest first

    def learn(self, ref: Ref, agent: str | None) -> None:
        self.time[ref] = self.clock
        self.clock += 1
        if agent is not None:
            self.owner[ref] = agent
            self.series.setdefault((ref.kind, agent), []).append(ref)

    def name(self, ref: Ref, horizon: int) -> str:
        """Counted back from `horizon`, the newest text the prompt holds: later texts of the
        same agent that this prompt does not reach do not make a text older."""
        if ref.kind == "question":
            return "user_question"
        agent = self.owner[ref]
        back = sum(1 for other in self.series[(ref.kind, agent)] if self.time[ref] < self.time[other] <= horizon)
        stem = "agent" if ref.kind == "output" else "condition"
        return f"{stem}_{agent}_{'current' if back == 0 else f'history_{back}'}"


def placeholder_labels(records: list[Record]) -> list[list[list[Any]]]:
    """Per request, [message_index, char_start, char_end, name] of every placeholder.

    The convention: `user_question` wherever the session's question is quoted (its first
    request included); `agent_<a>_current` / `_history_<k>` for an earlier answer of agent
    a; `condition_<a>_...` for a tool result that an earlier request of agent a carried
    first. Names count back from the newest session text the prompt holds (README,
    "Placeholders"), so every agent of an All-Gather round names the previous round's
    answers alike. See FIRST_TOOL_IS_PLACEHOLDER for a tool message's first appearance.
    """
    sessions: dict[tuple[str, str], _SessionTexts] = {}
    out = []
    for record in records:
        texts = sessions.setdefault((record.spec.app, record.spec.label), _SessionTexts())
        first_seen = set()
        for q in record.draft.quotes:
            if q.ref not in texts.time:
                if q.ref.kind == "output":
                    raise ValueError(f"{record.spec.trace}: quotes answer {q.ref.key} before it was given")
                first_seen.add(q.ref)
                texts.learn(q.ref, record.draft.agent if q.ref.kind == "tool" else None)
        horizon = max((texts.time[q.ref] for q in record.draft.quotes), default=-1)
        labels = [[q.message_index, q.start, q.end, texts.name(q.ref, horizon)] for q in record.draft.quotes
                  if q.ref.kind != "tool" or q.ref not in first_seen or FIRST_TOOL_IS_PLACEHOLDER]
        texts.learn(Ref("output", record.key), record.draft.agent)
        out.append(sorted(labels))
    return out


def round_labels(records: list[Record]) -> list[str | None]:
    """Per request, its round as the generator built it: the round of the app's own
    protocol (an All-Gather round, a KVCOMM debate round) on the requests that read
    earlier answers, None everywhere else (group chats, pipelines and loops have no
    rounds). Written where each prompt is drafted, never computed by a rule."""
    return [record.draft.round for record in records]


def true_edges(records: list[Record]) -> dict[str, list[list[str]]]:
    """Per app, [src, dst]: dst's prompts quote src's answers; an agent that quotes no one
    else's answer runs after whoever ran just before it in its sessions (a pure chain)."""
    reads: dict[tuple[str, str], set[str]] = {}
    follows: dict[tuple[str, str], set[str]] = {}
    producer: dict[tuple[str, str, str], str] = {}
    previous: dict[tuple[str, str], str] = {}
    for record in records:
        app, session, agent = record.spec.app, record.spec.label, record.draft.agent
        node = (app, agent)
        reads.setdefault(node, set())
        follows.setdefault(node, set())
        for q in record.draft.quotes:
            if q.ref.kind == "output" and producer[(app, session, q.ref.key)] != agent:
                reads[node].add(producer[(app, session, q.ref.key)])
        before = previous.get((app, session))
        if before is not None and before != agent:
            follows[node].add(before)
        previous[(app, session)] = agent
        producer[(app, session, record.key)] = agent
    edges: dict[str, list[list[str]]] = {}
    for (app, agent) in sorted(reads):
        for src in sorted(reads[(app, agent)] or follows[(app, agent)]):
            edges.setdefault(app, []).append([src, agent])
    return edges


def check_quotes(records: list[Record]) -> None:
    """Every quote sits inside its message, quotes do not overlap, and a quote reproduces
    exactly the text it names: the answer it refers to, or the same question or tool
    result as everywhere else in the session."""
    texts: dict[tuple[str, str, Ref], str] = {}
    for record in records:
        session = (record.spec.app, record.spec.label)
        for q in record.draft.quotes:
            content = record.draft.messages[q.message_index]["content"]
            assert 0 <= q.start < q.end <= len(content), (record.spec.trace, q)
            expected = texts.setdefault((*session, q.ref), content[q.start:q.end])
            assert content[q.start:q.end] == expected, f"{record.spec.trace}: {q.ref} quoted inexactly"
        spans = sorted((q.message_index, q.start, q.end) for q in record.draft.quotes)
        for (m1, _, e1), (m2, s2, _) in itertools.pairwise(spans):
            assert m1 != m2 or e1 <= s2, f"{record.spec.trace}: overlapping quotes"
        texts[(*session, Ref("output", record.key))] = record.response


def write_trace(trace: TraceSpec, records: list[Record], out_dir: Path) -> Path:
    check_quotes(records)
    labels = placeholder_labels(records)
    origins: dict[str, int] = {}
    for record in records:
        origins[record.origin] = origins.get(record.origin, 0) + 1
    header = {"trace": trace.name, "description": trace.description, "model": MODEL,
              "answers": dict(sorted(origins.items())), "edges": true_edges(records)}
    lines = [json.dumps(header, ensure_ascii=False)]
    for record, placeholders, round_label in zip(records, labels, round_labels(records)):
        spec, draft = record.spec, record.draft
        body = {"model": MODEL, "messages": draft.messages, **draft.extra_body,
                "max_tokens": MAX_TOKENS, "temperature": 0.0}
        line = {"headers": {"content-type": "application/json", **spec.headers}, "model": MODEL, "body": body,
                "response": record.response,
                "labels": {"app": spec.app, "session": spec.label, "agent": draft.agent,
                           "placeholders": placeholders, "round": round_label, "wave": record.wave}}
        lines.append(json.dumps(line, ensure_ascii=False))
    path = out_dir / f"{trace.name}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------------------------
# Small helpers for the scenarios.
# --------------------------------------------------------------------------------------


def variants(rng: random.Random, *parts: Sequence[str], sep: str = " ", limit: int = MAX_FALLBACKS) -> list[str]:
    """Up to `limit` distinct sentences made of one choice from each part, in seeded order."""
    combos = [sep.join(p for p in combo if p) for combo in itertools.product(*parts)]
    rng.shuffle(combos)
    return combos[:limit]


def openai_headers(framework: str) -> dict[str, str]:
    return {"user-agent": f"OpenAI/Python 1.54.4 ({framework})", "x-stainless-lang": "python"}


def call_id(rng: random.Random) -> str:
    return "call_" + "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz0123456789")
                             for _ in range(24))


def staggered(specs: Iterable[SessionSpec], rng: random.Random, spread: int = 2) -> list[SessionSpec]:
    """Let sessions start a few waves apart, so their requests interleave unevenly."""
    out = list(specs)
    for spec in out[1:]:
        spec.start_wave = rng.randint(0, spread)
    return out



# --------------------------------------------------------------------------------------
# KVCOMM / GPTSwarm, fully connected: each agent reads the question, the answers given
# earlier this round ("at the same time"), everyone's answers of the last round, and,
# for agents with memory, its own last answer and the answers of two rounds ago.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    question: str
    answer: str
    facts: tuple[str, ...]


MMLU = (
    Choice("Which gas makes up the largest share of the Earth's atmosphere by volume?\n"
           "A) Oxygen\nB) Nitrogen\nC) Carbon dioxide\nD) Argon", "B) Nitrogen",
           ("Dry air is about 78 percent nitrogen and 21 percent oxygen.",
            "Argon is below one percent and carbon dioxide is only a trace gas.",
            "Oxygen is second, well behind nitrogen.")),
    Choice("A train covers 180 km in 2.5 hours at a steady pace. What is its average speed?\n"
           "A) 60 km/h\nB) 72 km/h\nC) 75 km/h\nD) 90 km/h", "B) 72 km/h",
           ("Average speed is distance over time, and 180 / 2.5 = 72.",
            "2.5 hours times 72 km/h gives back exactly 180 km.",
            "75 km/h would cover 187.5 km, which is too far.")),
    Choice("Which organelle is the main site of ATP production in eukaryotic cells?\n"
           "A) Ribosome\nB) Golgi apparatus\nC) Lysosome\nD) Mitochondrion", "D) Mitochondrion",
           ("Oxidative phosphorylation happens on the inner mitochondrial membrane.",
            "Ribosomes build proteins and lysosomes digest waste; neither makes much ATP.",
            "The Golgi apparatus packages proteins rather than producing energy.")),
    Choice("In which year did the Berlin Wall fall?\nA) 1989\nB) 1987\nC) 1991\nD) 1993", "A) 1989",
           ("The border crossings opened on the night of 9 November 1989.",
            "German reunification followed in October 1990, a year after the wall fell.",
            "1991 is the year the Soviet Union dissolved, not the fall of the wall.")),
    Choice("What is the derivative of x^3 with respect to x?\nA) x^2\nB) 3x\nC) 3x^2\nD) x^4/4", "C) 3x^2",
           ("By the power rule, d/dx of x^n is n times x^(n-1).",
            "x^4/4 is the antiderivative, not the derivative.",
            "Checking at x = 2: the slope of x^3 there is 12, which equals 3 * 2^2.")),
    Choice("A contract signed by a minor is generally treated how under common law?\n"
           "A) Void from the start\nB) Voidable at the minor's option\nC) Fully enforceable against the minor\n"
           "D) A criminal offence", "B) Voidable at the minor's option",
           ("The minor may affirm the contract on reaching majority or disaffirm it.",
            "Contracts for necessaries are the usual exception, enforceable for a reasonable price.",
            "A void contract could not be ratified later, but a minor's contract can be.")),
    Choice("What is the worst-case time complexity of binary search on a sorted array of n elements?\n"
           "A) O(n)\nB) O(n log n)\nC) O(log n)\nD) O(1)", "C) O(log n)",
           ("Each comparison halves the remaining range, so about log2(n) steps are needed.",
            "A linear scan would be O(n); binary search avoids it by using the order.",
            "O(1) would require knowing the position in advance, as with hashing.")),
    Choice("Which blood vessels carry oxygen-rich blood from the heart to the rest of the body?\n"
           "A) Veins\nB) Arteries\nC) Capillaries\nD) Lymphatic vessels", "B) Arteries",
           ("The aorta and its branches carry oxygenated blood away from the left ventricle.",
            "Veins return blood to the heart, and capillaries are where exchange happens.",
            "The pulmonary artery is the famous exception, carrying oxygen-poor blood to the lungs.")),
    Choice("Which of these events would most likely shift the demand curve for umbrellas to the right?\n"
           "A) A fall in the price of umbrellas\nB) A forecast of a very rainy season\n"
           "C) A new tax on umbrella makers\nD) Cheaper nylon fabric", "B) A forecast of a very rainy season",
           ("A change in the good's own price moves along the curve instead of shifting it.",
            "Taxes on producers and cheaper inputs shift supply, not demand.",
            "Expected rain raises the quantity buyers want at every price.")),
)


@dataclass(frozen=True)
class Role:
    display: str
    system: str
    leads_first: tuple[str, ...]
    leads_after: tuple[str, ...]
    closers: tuple[str, ...]


KVCOMM_ROLES = {
    "expert": Role(
        "Knowledgeable Expert",
        "You are a knowledgeable expert in question answering. You are given a multiple-choice question and "
        "sometimes the answers of other agents. Recall the facts that decide the question and pick the best "
        "option. Start your reply with the letter of your choice, then justify it in at most two sentences.",
        ("The answer is", "I choose", "My answer is"),
        ("Having read the other agents, I still choose", "I agree with the others and choose",
         "The other answers do not change my view; I pick"),
        ("This is standard textbook knowledge.", "I am confident in this choice.", "No other option fits the facts.")),
    "critic": Role(
        "Critic",
        "You are a critic in a team of agents that answer multiple-choice questions together. Look for factual "
        "errors and gaps in the reasoning of the other agents before you commit to an option. Start with the "
        "letter you pick, then say in at most two sentences which argument you accept or reject.",
        ("On my own reading, I pick", "Before anyone argues, my pick is", "Without other input I would say"),
        ("I checked the reasoning above and accept", "The argument above has a gap, but the right option is still",
         "I reject the weaker arguments above and pick"),
        ("The other options rest on a common misconception.", "The justification should cite the key fact.",
         "I see no remaining error in this reasoning.")),
    "mathematician": Role(
        "Mathematician",
        "You are a mathematician. Work through the question with exact arithmetic or formal reasoning where "
        "possible and check every step. Give the letter of your choice first, then the key step of your "
        "argument in at most two sentences.",
        ("Working it out, I get", "By direct reasoning the answer is", "A careful check gives"),
        ("I verified the step the others rely on and get", "Recomputing independently, I also get",
         "The derivations above agree with mine:"),
        ("Each step can be checked by substitution.", "The reasoning is exact, with no estimate involved.",
         "A quick sanity check confirms it.")),
    "historian": Role(
        "Historian",
        "You are a historian. Bring in the historical and institutional background that bears on the question, "
        "note where common memory gets dates or causes wrong, and choose an option. Lead with the letter, then "
        "give the context in at most two sentences.",
        ("From the record, the answer is", "Historically speaking, I choose", "The sources point to"),
        ("The other agents' points fit the record, so I choose", "Setting the background straight, I still choose",
         "Weighing the accounts above, I choose"),
        ("Textbooks have taught it this way for decades.", "The background makes the choice clear.",
         "It is a frequent mix-up in popular accounts.")),
    "scientist": Role(
        "Scientist",
        "You are a scientist. Judge the options by the mechanism behind them and by the evidence, and prefer "
        "the explanation that predicts the most. Name your chosen letter first, then the mechanism in at most "
        "two sentences.",
        ("Based on the mechanism, I pick", "The evidence supports", "Experimentally, the answer is"),
        ("The mechanism the others describe is right, so I pick", "Testing the claims above against evidence, I pick",
         "After weighing the other answers, the evidence still supports"),
        ("This is what measurements show.", "The mechanism explains every observation.",
         "Any other option would contradict basic data.")),
}


def kvcomm_fallbacks(rng: random.Random, role: Role, item: Choice, read_others: bool) -> list[str]:
    leads = role.leads_after if read_others else role.leads_first
    return variants(rng, [f"{lead} {item.answer}." for lead in leads], item.facts, role.closers)


def _agent_block(content: Content, number: int, role: str, said: Said) -> None:
    content.text(f"Agent {number}, role is {KVCOMM_ROLES[role].display}, output is:\n\n").said(said).text("\n\n")


def kvcomm_session(item: Choice, roles: list[str], rounds: int, memory: frozenset[str],
                   label: str) -> Callable[[random.Random], SessionRun]:
    def run(rng: random.Random) -> SessionRun:
        history: dict[str, list[Said]] = {role: [] for role in roles}
        for r in range(rounds):
            for j, role in enumerate(roles):
                prompt = Prompt()
                prompt.add("system").text(KVCOMM_ROLES[role].system)
                user = prompt.add("user").quote(item.question, QUESTION)
                others = [o for o in roles if o != role]
                if j > 0:
                    user.text("\n\nAt the same time, the outputs of other agents are as follows:\n\n")
                    for i in range(j):
                        _agent_block(user, i + 1, roles[i], history[roles[i]][r])
                if r > 0:
                    user.text("\n\n" if j == 0 else "").text(
                        "In the last round of dialogue, the outputs of other agents were:\n\n")
                    for other in others:
                        _agent_block(user, roles.index(other) + 1, other, history[other][r - 1])
                    if role in memory:
                        user.text("Your own output in the last round was:\n\n").said(history[role][r - 1]).text("\n\n")
                    if role in memory and r > 1:
                        user.text("Two rounds ago, the outputs of other agents were:\n\n")
                        for other in others:
                            _agent_block(user, roles.index(other) + 1, other, history[other][r - 2])
                fallbacks = kvcomm_fallbacks(rng, KVCOMM_ROLES[role], item, j > 0 or r > 0)
                round_label = f"{label}/round{r + 1}" if j > 0 or r > 0 else None  # reads answers of this round or the last
                [said] = yield [prompt.draft(role, fallbacks, round_label)]
                history[role].append(said)
    return run


def kvcomm_trace(n: int, num_sessions: int, rounds: int, memory: frozenset[str], seed: int) -> TraceSpec:
    rng = random.Random(f"kvcomm-{n}-{seed}")
    roles = list(KVCOMM_ROLES)[:n]
    items = rng.sample(MMLU, num_sessions)
    name = f"kvcomm_{n}agents"
    specs = [SessionSpec(name, "default", f"s{i + 1}", kvcomm_session(item, roles, rounds, memory, f"s{i + 1}"),
                         openai_headers("gptswarm")) for i, item in enumerate(items)]
    return TraceSpec(name, f"KVCOMM/GPTSwarm fully connected, {n} agents, {rounds} rounds: each prompt holds the "
                     "question, this round's earlier answers, last round's answers of all others, and for some "
                     "agents their own last answer and the answers of two rounds ago.",
                     staggered(specs, rng))


# --------------------------------------------------------------------------------------
# Generative Agents, All-Gather: every round, each agent reads every agent's answer of
# the previous round (its own included), in its own shuffled order.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Persona:
    id: str
    name: str
    age: int
    bio: str
    plans: tuple[str, ...]


PERSONAS = (
    Persona("isabella", "Isabella Rodriguez", 34,
            "You run Hobbs Cafe on Main Street. You are warm, love bringing people together and know most of the "
            "town by their coffee order.",
            ("I will put up a notice at the cafe counter tonight.", "I am going to bake extra pastries for tomorrow.",
             "I will ask Maria to help me spread the word.")),
    Persona("klaus", "Klaus Mueller", 20,
            "You study sociology at Oak Hill College and are writing a research paper on gentrification in "
            "low-income communities. You are thoughtful and a little shy.",
            ("I will take notes on this for my paper on the neighbourhood.",
             "I am heading to the library to finish a chapter first.", "I will ask Maria what she thinks about it.")),
    Persona("maria", "Maria Lopez", 21,
            "You study physics at Oak Hill College, stream games in the evening and have a quiet crush on Klaus.",
            ("I will mention it on my stream tonight.", "I might go, but only if Klaus is going too.",
             "I will finish my physics problem set first and then decide.")),
    Persona("sam", "Sam Moore", 65,
            "You are a retired navy officer who has lived in Smallville all your life, and you are thinking of "
            "running for mayor in the local election.",
            ("I will raise this at the town hall meeting on Thursday.",
             "I am going to talk to the neighbours about it this evening.",
             "I will write a short note for the Smallville newsletter.")),
    Persona("carmen", "Carmen Ortiz", 42,
            "You own the Harvey Oak Supply Store and care about keeping prices fair for your neighbours.",
            ("I will stock up on candles and batteries at the store.", "I will put a sign in the shop window.",
             "I am going to ask my suppliers whether deliveries will be late.")),
    Persona("tom", "Tom Moreno", 48,
            "You co-own the grocery store with your wife and worry about how town decisions affect small "
            "businesses.",
            ("I will tell my wife about it as soon as I get home.", "I will check how this affects our delivery van.",
             "I am going to ask Sam what the council is planning.")),
    Persona("jennifer", "Jennifer Moore", 63,
            "You are a watercolour painter who walks through town every morning and paints what you see.",
            ("I will sketch the scene this evening while it is still fresh.",
             "I am going to bring my paints and set up near the square.",
             "I will ask Isabella if I can hang a painting at the cafe.")),
    Persona("adam", "Adam Smith", 58,
            "You are a philosopher who writes essays on ethics and enjoys long debates at the pharmacy counter.",
            ("I will write a few pages about it in my journal tonight.",
             "I am going to bring it up in my reading group on Friday.",
             "I will take a long walk and think it over first.")),
    Persona("yuriko", "Yuriko Yamamoto", 39,
            "You are a tax lawyer with an office above the bakery and a habit of reading every public notice "
            "twice.",
            ("I will read the official notice carefully before I say more.",
             "I am going to check whether the town followed the proper procedure.",
             "I will offer to answer questions for anyone who is confused.")),
    Persona("wolfgang", "Wolfgang Schulz", 22,
            "You study chemistry at Oak Hill College, run every morning and are always short of money.",
            ("I will go for a run first and then see where everyone is.",
             "I am going to ask my roommate whether he heard about it.",
             "I will come along if there is free food.")),
)


@dataclass(frozen=True)
class Scene:
    text: str
    day: str
    times: tuple[str, ...]
    reactions: tuple[str, ...]


SCENES = (
    Scene("It is February 13, 2023, at Hobbs Cafe in Smallville. Isabella Rodriguez has just told the customers "
          "that she is throwing a Valentine's Day party at the cafe tomorrow from 5 to 7 pm, and that everyone in "
          "town is welcome to come.", "February 13, 2023", ("5:00 pm", "5:10 pm", "5:20 pm"),
          ("A party at the cafe sounds like a lovely idea.", "Tomorrow evening is short notice for a party.",
           "It would be nice to see the whole town in one place.", "I wonder how many people will actually come.")),
    Scene("It is March 2, 2023, in the Smallville town square. Sam Moore has just announced that he will run for "
          "mayor in the April election, promising to repair the old bridge and to open the library on Sundays.",
          "March 2, 2023", ("10:00 am", "10:10 am", "10:20 am"),
          ("An election campaign will shake things up in this quiet town.", "Fixing the bridge is long overdue.",
           "Sunday opening at the library would help a lot of students.",
           "I am not sure the town budget can pay for all of that.")),
    Scene("It is April 18, 2023, and a notice on the door of the Smallville public library says it will close for "
          "two weeks starting Monday because a water pipe burst in the reading room overnight.", "April 18, 2023",
          ("9:00 am", "9:10 am", "9:20 am"),
          ("Two weeks without the library will hurt everyone who studies there.",
           "At least nobody was hurt when the pipe burst.", "The town should have fixed those old pipes years ago.",
           "Maybe the cafe could host a reading corner in the meantime.")),
    Scene("It is May 6, 2023. The town council has announced that from next Saturday the weekly farmers market "
          "will move from the church parking lot to Johnson Park, where there is more shade and room for twenty "
          "more stalls.", "May 6, 2023", ("8:00 am", "8:10 am", "8:20 am"),
          ("Johnson Park is a much nicer place for the market.", "The park is a longer walk for older residents.",
           "More stalls means more choice for everyone.", "Parking near the park could become a problem.")),
    Scene("It is June 21, 2023, the morning after a thunderstorm knocked out the power on the north side of "
          "Smallville for nine hours. Several shops lost refrigerated stock and the traffic lights on Main Street "
          "are still blinking.", "June 21, 2023", ("7:30 am", "7:40 am", "7:50 am"),
          ("Nine hours without power is a long time for the shops.", "I hope the elderly neighbours are all right.",
           "The blinking traffic lights make Main Street dangerous this morning.",
           "The power company should explain what went wrong.")),
    Scene("It is September 9, 2023, opening night at the Smallville community center, where an exhibition of "
          "local watercolours has just opened, with free lemonade and a talk by the painters at 7 pm.",
          "September 9, 2023", ("6:30 pm", "6:40 pm", "6:50 pm"),
          ("An art show is a wonderful thing for a small town.", "Free lemonade always brings people out.",
           "I did not know we had so many painters in Smallville.", "The talk at 7 pm could be interesting.")),
)

_GATHER_OPENERS = ("Oh, that is big news.", "Hmm, I did not expect that.", "Well, that changes my day a little.",
                   "I heard people talking about it earlier.")
_GATHER_LATER = ("It is good to hear what everyone thinks.", "I agree with most of what was said.",
                 "Some of you sound worried, but I am not.", "Listening to the others, I changed my mind a bit.")


def persona_system(persona: Persona, scene: Scene, time: str) -> str:
    first = persona.name.split()[0]
    return (f"You are {persona.name}, {persona.age} years old. {persona.bio}\nStay in character. In two or three "
            f"sentences, react to what is happening in Smallville and say what you will do next, as {first} "
            f"would.\nCurrent time: {scene.day}, {time}.")


def gather_session(scene: Scene, members: list[Persona], rounds: int, label: str,
                   ttsep: bool) -> Callable[[random.Random], SessionRun]:
    def run(rng: random.Random) -> SessionRun:
        last: dict[str, Said] = {}
        for r in range(rounds):
            drafts = []
            for persona in rng.sample(members, len(members)):  # who speaks first this round
                prompt = Prompt()
                prompt.add("system").text(persona_system(persona, scene, scene.times[r]))
                user = prompt.add("user").quote(scene.text, QUESTION)
                if r > 0:
                    user.text("<TTSEP>What everyone said in the last round:<TTSEP>" if ttsep
                              else "\n\nWhat everyone said in the last round:\n\n")
                    for n, other in enumerate(rng.sample(members, len(members))):
                        user.text(("<TTSEP>" if ttsep else "\n\n") if n else "")
                        user.text(f"{other.name}: ").said(last[other.id])
                openers = _GATHER_LATER if r else _GATHER_OPENERS
                fallbacks = variants(rng, openers, scene.reactions, persona.plans)
                drafts.append(prompt.draft(persona.id, fallbacks, f"{label}/round{r + 1}" if r else None))
            said = yield drafts
            last = {s.agent: s for s in said}
    return run


def gather_trace(name: str, ttsep: bool, plan: list[tuple[int, int]], scenes: Sequence[Scene]) -> TraceSpec:
    rng = random.Random(name)
    specs = []
    for i, ((size, rounds), scene) in enumerate(zip(plan, scenes)):
        members = rng.sample(PERSONAS, size)
        label = f"s{i + 1}"
        specs.append(SessionSpec(name, "default", label, gather_session(scene, members, rounds, label, ttsep),
                                 openai_headers("generative-agents")))
    joined = "<TTSEP> separators (each answer its own block)" if ttsep else "plain text"
    sizes = ", ".join(f"{size} agents x {rounds} rounds" for size, rounds in plan)
    return TraceSpec(name, f"Generative-Agents All-Gather ({sizes}): every round each agent reads all answers of the "
                     f"previous round in its own shuffled order, joined with {joined}; rounds 2+ are labelled.",
                     staggered(specs, rng))


# --------------------------------------------------------------------------------------
# ReAct and Reflexion: tool results come back as role "tool" messages; the agent's own
# thoughts and earlier tool results are re-sent on every step.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolUse:
    tool: str
    arguments: dict[str, str]
    result: str


@dataclass(frozen=True)
class Step:
    thoughts: tuple[str, ...]  # template answers for this step
    tools: tuple[ToolUse, ...] = ()  # empty: the final answer


TOOLS_SCHEMA = [
    {"type": "function", "function": {
        "name": "search", "description": "The first paragraph of the encyclopedia article that best matches the query.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "lookup", "description": "The sentences of an article that contain a keyword.",
        "parameters": {"type": "object", "properties": {"article": {"type": "string"}, "keyword": {"type": "string"}},
                       "required": ["article", "keyword"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]

REACT_SYSTEM = (
    "Answer the question by interleaving Thought, Action and Observation steps. A Thought reasons about the "
    "current situation; an Action calls one of your tools: search(query) returns the first paragraph of the best "
    "matching encyclopedia article, lookup(article, keyword) returns the sentences of an article that contain a "
    "keyword, and calculator(expression) evaluates arithmetic. You may call several tools at once when the calls "
    "do not depend on each other. When you know the answer, reply with 'Final Answer:' followed by the answer.")

REACT_TASKS = (
    ("Which magazine was started first, Arthur's Magazine or First for Women?", (
        Step(("Thought: I need the founding years of both magazines. I will search for both at once.",
              "Thought: To compare them I should look up when each magazine was first published."), (
            ToolUse("search", {"query": "Arthur's Magazine"},
                    "Arthur's Magazine (1844-1846) was an American literary periodical published in Philadelphia. "
                    "Edited by Timothy Shay Arthur, it printed work by Edgar Allan Poe and Sarah Josepha Hale."),
            ToolUse("search", {"query": "First for Women"},
                    "First for Women is a women's magazine published in the United States by Bauer Media Group. It "
                    "was started in 1989 and is based in Englewood Cliffs, New Jersey."))),
        Step(("Thought: Arthur's Magazine began in 1844 and First for Women in 1989, so Arthur's Magazine came "
              "first.\nFinal Answer: Arthur's Magazine",
              "Thought: 1844 is long before 1989.\nFinal Answer: Arthur's Magazine was started first.")),
    )),
    ("What is the population density of Iceland in people per square kilometre, to one decimal place?", (
        Step(("Thought: I need Iceland's area and population. I will start with the encyclopedia article.",
              "Thought: First I should search for Iceland to find its land area."), (
            ToolUse("search", {"query": "Iceland"},
                    "Iceland is a Nordic island country between the North Atlantic and the Arctic Ocean. With an "
                    "area of about 103,000 square kilometres, it is the most sparsely populated country in Europe."),)),
        Step(("Thought: The paragraph gives the area but not the population. I will look up the population.",
              "Thought: I have the area; now I need the exact population figure."), (
            ToolUse("lookup", {"article": "Iceland", "keyword": "population"},
                    "Iceland's population was 387,758 on 1 January 2023 according to Statistics Iceland; about two "
                    "thirds of the inhabitants live in the capital region around Reykjavik."),)),
        Step(("Thought: Density is population divided by area. I will compute 387758 / 103000.",
              "Thought: Now I can divide the population by the area with the calculator."), (
            ToolUse("calculator", {"expression": "387758 / 103000"},
                    '{"expression": "387758 / 103000", "result": 3.764640776699029}'),)),
        Step(("Thought: 3.76 rounds to 3.8.\nFinal Answer: about 3.8 people per square kilometre.",
              "Thought: The result is 3.7646, which is 3.8 to one decimal.\nFinal Answer: 3.8 per km2")),
    )),
    ("Who directed the film that won the Academy Award for Best Picture for the year in which the Channel Tunnel "
     "opened?", (
        Step(("Thought: First I need the year the Channel Tunnel opened.",
              "Thought: I should find out when the Channel Tunnel was opened to traffic."), (
            ToolUse("search", {"query": "Channel Tunnel"},
                    "The Channel Tunnel is a 50.46-kilometre railway tunnel beneath the English Channel, linking "
                    "Folkestone in Kent with Coquelles near Calais. It was officially opened on 6 May 1994."),)),
        Step(("Thought: The tunnel opened in 1994, so I need the Best Picture winner among the films of 1994.",
              "Thought: The films of 1994 were honoured at the 67th Academy Awards. I will search for them."), (
            ToolUse("search", {"query": "67th Academy Awards"},
                    "The 67th Academy Awards ceremony, held on 27 March 1995, honoured the best films of 1994. "
                    "Forrest Gump won Best Picture and five other awards, including Best Actor for Tom Hanks."),)),
        Step(("Thought: Forrest Gump won. Now I need its director.",
              "Thought: I will look up who directed Forrest Gump."), (
            ToolUse("lookup", {"article": "Forrest Gump", "keyword": "directed"},
                    "Forrest Gump is a 1994 American comedy-drama film directed by Robert Zemeckis and written by "
                    "Eric Roth, based on the 1986 novel by Winston Groom."),)),
        Step(("Thought: The director of Forrest Gump is Robert Zemeckis.\nFinal Answer: Robert Zemeckis",
              "Thought: So the answer is the director of Forrest Gump.\nFinal Answer: Robert Zemeckis directed it.")),
    )),
)


def _tool_calls(rng: random.Random, uses: Sequence[ToolUse]) -> list[dict[str, Any]]:
    return [{"id": call_id(rng), "type": "function",
             "function": {"name": u.tool, "arguments": json.dumps(u.arguments, ensure_ascii=False)}} for u in uses]


@dataclass
class _Turn:
    """A step already taken: the agent's answer, its tool calls and the tool results."""

    said: Said
    calls: list[dict[str, Any]]
    results: list[tuple[str, str]]  # (tool key, text)


def _replay_turns(prompt: Prompt, turns: list[_Turn]) -> None:
    for turn in turns:
        prompt.add("assistant", tool_calls=turn.calls).said(turn.said)
        for call, (key, text) in zip(turn.calls, turn.results):
            prompt.add("tool", tool_call_id=call["id"]).quote(text, Ref("tool", key))


def _step_fallbacks(rng: random.Random, step: Step) -> list[str]:
    return variants(rng, step.thoughts, ("", "I will be careful with the details.", "Let me check this properly."))


def react_session(question: str, steps: Sequence[Step]) -> Callable[[random.Random], SessionRun]:
    """A session that is one ReAct episode."""
    def run(rng: random.Random) -> SessionRun:
        yield from react_episode(rng, question, steps, "react_agent", REACT_SYSTEM, TOOLS_SCHEMA, "t", None, [])
    return run


def react_episode(rng: random.Random, question: str, steps: Sequence[Step], agent: str, system: str,
                  tools: list[dict[str, Any]], tool_prefix: str, intro: Callable[[Content], None] | None,
                  turns: list[_Turn]) -> SessionRun:
    """Run the steps, appending each taken step to `turns` (the caller reads them after)."""
    for n, step in enumerate(steps):
        prompt = Prompt()
        prompt.add("system").text(system)
        user = prompt.add("user").quote(question, QUESTION)
        if intro is not None:
            intro(user)
        _replay_turns(prompt, turns)
        calls = _tool_calls(rng, step.tools)
        [said] = yield [prompt.draft(agent, _step_fallbacks(rng, step), tools=tools)]
        results = [(f"{tool_prefix}{n}.{i}", use.result) for i, use in enumerate(step.tools)]
        turns.append(_Turn(said, calls, results))


def react_trace() -> TraceSpec:
    rng = random.Random("react")
    name = "react_tools"
    specs = [SessionSpec(name, "default", f"s{i + 1}",
                         react_session(question, steps),
                         openai_headers("langchain"))
             for i, (question, steps) in enumerate(REACT_TASKS)]
    return TraceSpec(name, "ReAct with OpenAI tool calling: each step re-sends the question, the agent's earlier "
                     "thoughts (assistant messages with tool_calls) and the tool results (role 'tool', parallel "
                     "calls included); re-sent tool results are condition_* placeholders.", staggered(specs, rng))


ACTOR_SYSTEM = (
    "You are an agent that answers questions by reasoning step by step and calling tools: search(query) returns "
    "the first paragraph of the best matching encyclopedia article, and calculator(expression) evaluates "
    "arithmetic. When you are sure, reply with 'Final Answer:' and the answer. If reflections on earlier attempts "
    "are given, use them so you do not repeat the same mistake.")
ACTOR_TOOLS = [t for t in TOOLS_SCHEMA if t["function"]["name"] in ("search", "calculator")]
EVALUATOR_SYSTEM = (
    "You are an evaluator. You are given a question and an agent's trajectory: its thoughts, the tool "
    "observations and its final answer. Decide whether the final answer is correct. Reply with CORRECT or "
    "INCORRECT, then one sentence explaining why.")
REFLECTOR_SYSTEM = (
    "You are a self-reflection module. The agent below did not answer the question correctly. In two or three "
    "sentences, diagnose the mistake in its trajectory and write a concrete plan that avoids it in the next "
    "attempt.")


@dataclass(frozen=True)
class Trial:
    steps: tuple[Step, ...]
    verdicts: tuple[str, ...]
    reflections: tuple[str, ...] = ()  # empty: the last trial, nothing to reflect on


REFLEXION_TASKS = (
    ("What is the capital of the country that hosted the 2016 Summer Olympics?", (
        Trial((Step(("Thought: I need to know where the 2016 Summer Olympics were held.",
                     "Thought: Let me search for the 2016 Summer Olympics first."), (
                   ToolUse("search", {"query": "2016 Summer Olympics"},
                           "The 2016 Summer Olympics were held in Rio de Janeiro, Brazil, from 5 to 21 August 2016, "
                           "the first Olympic Games to take place in South America."),)),
               Step(("Thought: The Games were held in Rio de Janeiro.\nFinal Answer: Rio de Janeiro",
                     "Thought: Rio de Janeiro hosted them.\nFinal Answer: Rio de Janeiro, Brazil"))),
              ("INCORRECT. Rio de Janeiro is the host city, but the question asks for the capital of Brazil.",
               "INCORRECT. The answer names the host city instead of the capital of the host country."),
              ("I answered with the host city when the question asked for the capital of the host country. Next "
               "time I will first find the host country and then search for that country's capital.",
               "My mistake was stopping at the city where the Games took place. In the next attempt I will look up "
               "the capital of Brazil before answering.")),
        Trial((Step(("Thought: My reflection says the host country is Brazil; I need the capital of Brazil.",
                     "Thought: This time I will search for Brazil to find its capital."), (
                   ToolUse("search", {"query": "Brazil"},
                           "Brazil is the largest country in South America, with over 200 million inhabitants. Its "
                           "capital is Brasilia, while its most populous city is Sao Paulo."),)),
               Step(("Thought: The capital of Brazil is Brasilia.\nFinal Answer: Brasilia",
                     "Thought: Brasilia is the capital, not Rio.\nFinal Answer: Brasilia"))),
              ("CORRECT. Brazil hosted the 2016 Games and its capital is Brasilia.",
               "CORRECT. The final answer gives the capital of the host country, Brasilia.")),
    )),
    ("How many years passed between the founding of Balliol College, Oxford, and the first publication of "
     "Newton's Principia?", (
        Trial((Step(("Thought: I need the founding year of Balliol College.",
                     "Thought: Let me search for Balliol College to find when it was founded."), (
                   ToolUse("search", {"query": "Balliol College"},
                           "Balliol College is one of the constituent colleges of the University of Oxford. It was "
                           "founded in about 1263 by John I de Balliol under the guidance of the Bishop of Durham."),)),
               Step(("Thought: The Principia came out in 1689, so I subtract 1263 from 1689.",
                     "Thought: I remember the Principia as 1689; the calculator can do the subtraction."), (
                   ToolUse("calculator", {"expression": "1689 - 1263"},
                           '{"expression": "1689 - 1263", "result": 426, "unit": null}'),)),
               Step(("Thought: The difference is 426.\nFinal Answer: 426 years",
                     "Thought: So 426 years passed.\nFinal Answer: 426"))),
              ("INCORRECT. The Principia was first published in 1687, not 1689, so the gap is 424 years.",
               "INCORRECT. The trajectory assumed the wrong publication year for the Principia."),
              ("I assumed the publication year of the Principia from memory instead of checking it. Next time I "
               "will search for both dates before doing any arithmetic.",
               "The calculation was right but one input was wrong: I never verified 1689. In the next attempt I "
               "will look up the Principia's publication date.")),
        Trial((Step(("Thought: Balliol was founded in about 1263; this time I will check the Principia's date.",
                     "Thought: Following my reflection, I will search for the Principia first."), (
                   ToolUse("search", {"query": "Philosophiae Naturalis Principia Mathematica"},
                           "Philosophiae Naturalis Principia Mathematica is a book by Isaac Newton that sets out his "
                           "laws of motion and universal gravitation. It was first published on 5 July 1687."),)),
               Step(("Thought: Now I subtract 1263 from 1687.",
                     "Thought: With both dates checked, I compute 1687 - 1263."), (
                   ToolUse("calculator", {"expression": "1687 - 1263"},
                           '{"expression": "1687 - 1263", "result": 424, "unit": null}'),)),
               Step(("Thought: The gap is 424 years.\nFinal Answer: 424 years",
                     "Thought: 424 years separate the two events.\nFinal Answer: 424"))),
              ("CORRECT. 1687 minus 1263 is 424, and both dates are right.",
               "CORRECT. The answer uses the verified dates and the arithmetic is right.")),
    )),
)


def _trajectory(content: Content, turns: list[_Turn]) -> None:
    """The trajectory as evaluators read it: thoughts and observations quoted in one message."""
    for n, turn in enumerate(turns, start=1):
        content.text(f"Thought {n}: ").said(turn.said).text("\n")
        for key, text in turn.results:
            content.text(f"Observation {n}: ").quote(text, Ref("tool", key)).text("\n")


def _reflections_intro(known: tuple[Said, ...], user: Content) -> None:
    """What the actor of a later trial reads after the question."""
    if known:
        user.text("\n\nReflections on your earlier attempts:\n")
        for said in known:
            user.text("- ").said(said).text("\n")


def reflexion_session(question: str, trials: Sequence[Trial]) -> Callable[[random.Random], SessionRun]:
    def run(rng: random.Random) -> SessionRun:
        reflections: list[Said] = []
        for t, trial in enumerate(trials):
            intro = functools.partial(_reflections_intro, tuple(reflections))
            turns: list[_Turn] = []
            yield from react_episode(rng, question, trial.steps, "actor", ACTOR_SYSTEM, ACTOR_TOOLS, f"t{t}.", intro,
                                     turns)
            prompt = Prompt()
            prompt.add("system").text(EVALUATOR_SYSTEM)
            user = prompt.add("user").text("Question: ").quote(question, QUESTION).text("\n\nTrajectory:\n")
            _trajectory(user, turns)
            [verdict] = yield [prompt.draft("evaluator", variants(rng, trial.verdicts, ("", "Well done otherwise.")))]
            if not trial.reflections:
                continue
            prompt = Prompt()
            prompt.add("system").text(REFLECTOR_SYSTEM)
            user = prompt.add("user").text("Question: ").quote(question, QUESTION).text("\n\nTrajectory:\n")
            _trajectory(user, turns)
            user.text("\nEvaluation: ").said(verdict)
            [reflection] = yield [prompt.draft("reflector", variants(rng, trial.reflections, ("",)))]
            reflections.append(reflection)
    return run


def reflexion_trace() -> TraceSpec:
    rng = random.Random("reflexion")
    name = "reflexion"
    specs = [SessionSpec(name, "default", f"s{i + 1}", reflexion_session(question, trials), openai_headers("reflexion"))
             for i, (question, trials) in enumerate(REFLEXION_TASKS)]
    return TraceSpec(name, "Reflexion: an actor with tools (role 'tool' results), an evaluator that reads the "
                     "quoted trajectory (thoughts and tool results), a reflector that reads trajectory and verdict; "
                     "the next trial's actor reads the reflections.", staggered(specs, rng, spread=1))


# --------------------------------------------------------------------------------------
# A sequential Planner -> Executor -> Expresser -> Reviewer loop.
# --------------------------------------------------------------------------------------

PIPELINE_SYSTEMS = {
    "planner": "You are the Planner in a four-step team (Planner, Executor, Expresser, Reviewer). Break the user's "
               "task into at most four numbered steps that the Executor can follow. Do not solve the task yourself.",
    "executor": "You are the Executor. Follow the plan step by step, show the intermediate results, and do every "
                "calculation carefully.",
    "expresser": "You are the Expresser. Turn the Executor's results into a clear, friendly final answer for the "
                 "user. Do not add facts that are not in the results.",
    "reviewer": "You are the Reviewer. Check the final answer against the task and the plan. Reply with APPROVED "
                "if it is correct and complete, otherwise with a short list of concrete problems to fix.",
}


@dataclass(frozen=True)
class PipelineTask:
    question: str
    plans: tuple[str, ...]  # one per iteration
    results: tuple[str, ...]
    answers: tuple[str, ...]
    reviews: tuple[str, ...]


PIPELINE_TASKS = (
    PipelineTask(
        "A savings account pays 4.5% interest per year, compounded monthly. If I deposit $2,000 today and add $150 "
        "at the end of every month, how much will I have after 3 years?",
        ("1. Convert the rate to a monthly rate.\n2. Grow the $2,000 deposit for 36 months.\n3. Compute the future "
         "value of the 36 monthly payments.\n4. Add the two amounts.",
         "1. Use r = 0.045 / 12 exactly, not a rounded value.\n2. Compute 2000 * (1 + r)^36.\n3. Compute 150 * "
         "((1 + r)^36 - 1) / r.\n4. Add both and round to the cent.",
         "1. Keep the exact monthly rate.\n2. Recompute both parts with that rate.\n3. Add them and state the total "
         "with the assumptions."),
        ("Monthly rate 0.375%. The deposit grows to about $2,287. The payments grow to about $5,800. Total about "
         "$8,087.", "r = 0.00375, (1 + r)^36 = 1.14415. Deposit: $2,288.30. Payments: 150 * 38.4394 = $5,765.91. "
         "Total: $8,054.21.", "Same inputs, exact rate: deposit $2,288.30, payments $5,765.91, total $8,054.21."),
        ("After 3 years you would have roughly $8,087 in the account.",
         "After 3 years you will have $8,054.21: $2,288.30 from your first deposit and $5,765.91 from the monthly "
         "payments.", "You will have $8,054.21 after 3 years, assuming the rate stays at 4.5% and you pay in on time."),
        ("The payment part is off: 150 * 38.44 is $5,765.91, not $5,800. Please redo step 3 with the exact rate.",
         "Mostly right, but the answer should state the assumption that the rate stays fixed for 3 years.",
         "APPROVED. The total of $8,054.21 matches the plan and the assumptions are stated.")),
    PipelineTask(
        "Our web service's p95 latency rose from 180 ms to 420 ms after yesterday's deploy, which reduced the "
        "database connection pool from 50 to 10 connections and added request logging. Explain the likely cause "
        "and what to check first.",
        ("1. Compare the pool size with peak concurrent requests.\n2. Check the time requests wait for a "
         "connection.\n3. Measure the cost of the new logging.\n4. Rank the two causes.",
         "1. Pull the pool wait-time metric for the last 48 hours.\n2. Compare peak concurrency with the 10 "
         "connections.\n3. Sample a trace to time the logging call.\n4. Recommend the first fix."),
        ("Peak concurrency is about 35 requests, far above 10 connections, so requests queue for a connection. "
         "Logging adds about 3 ms per request.", "Pool wait p95 is 230 ms since the deploy, 0 ms before. Logging "
         "costs 2-4 ms. The queueing explains almost all of the 240 ms increase."),
        ("The slowdown most likely comes from the smaller connection pool: requests now wait for a free database "
         "connection. Logging adds only a few milliseconds.", "Requests are waiting for database connections: the "
         "pool shrank from 50 to 10 while about 35 requests run at peak. Check the pool wait metric first, then "
         "restore a larger pool."),
        ("The answer should say what to check first, as the task asks, and give a number for the pool wait.",
         "APPROVED. The cause is supported by the wait-time metric and the first check is named.")),
    PipelineTask(
        "Write a short product description, under 80 words, for a stainless-steel insulated water bottle that keeps "
        "drinks cold for 24 hours and hot for 12.",
        ("1. List the key features: steel, insulation, 24 h cold, 12 h hot.\n2. Pick a friendly tone.\n3. Draft "
         "three sentences.\n4. Check the word count.",
         "1. Lead with the benefit, not the material.\n2. Mention both temperature claims exactly.\n3. Keep it "
         "under 60 words.\n4. End with a call to action."),
        ("Features: 18/8 stainless steel, double-wall vacuum insulation, cold 24 h, hot 12 h, leak-proof lid. Draft "
         "of 52 words written.", "Benefit first: drinks stay the way you like them. Claims: cold 24 h, hot 12 h. "
         "Draft of 47 words with a closing call to action."),
        ("Meet your new everyday bottle: double-wall stainless steel keeps water icy for 24 hours and coffee hot for "
         "12. Leak-proof and built to last.", "Ice-cold water at the end of a long day, hot coffee on an early hike: "
         "this insulated steel bottle keeps drinks cold for 24 hours and hot for 12. Grab yours today."),
        ("Good start, but it opens with the material; lead with the benefit and add a call to action.",
         "APPROVED. Under 80 words, both temperature claims are exact and it ends with a call to action.")),
)


def _pick(texts: tuple[str, ...], n: int) -> str:
    return texts[min(n, len(texts) - 1)]


def _said_fallbacks(rng: random.Random, text: str) -> list[str]:
    """The hand-written answer, then (only if an identical text already exists) lightly varied ones."""
    return [text, *variants(rng, ("Here is my part.", "Done.", "Update:"), (text,))]


def pipeline_session(task: PipelineTask, iterations: int) -> Callable[[random.Random], SessionRun]:
    def run(rng: random.Random) -> SessionRun:
        plan: Said | None = None
        review: Said | None = None
        for it in range(iterations):
            prompt = Prompt()
            prompt.add("system").text(PIPELINE_SYSTEMS["planner"])
            user = prompt.add("user").quote(task.question, QUESTION)
            if plan is not None and review is not None:
                user.text("\n\nYour previous plan:\n").said(plan).text("\n\nReviewer feedback:\n").said(review)
                user.text("\n\nWrite an improved plan.")
            [plan] = yield [prompt.draft("planner", _said_fallbacks(rng, _pick(task.plans, it)))]

            prompt = Prompt()
            prompt.add("system").text(PIPELINE_SYSTEMS["executor"])
            prompt.add("user").text("Task: ").quote(task.question, QUESTION).text("\n\nPlan:\n").said(plan).text(
                "\n\nCarry out the plan and report the intermediate results.")
            [result] = yield [prompt.draft("executor", _said_fallbacks(rng, _pick(task.results, it)))]

            prompt = Prompt()
            prompt.add("system").text(PIPELINE_SYSTEMS["expresser"])
            prompt.add("user").text("Task: ").quote(task.question, QUESTION).text("\n\nResults from the executor:\n") \
                .said(result).text("\n\nWrite the final answer for the user.")
            [answer] = yield [prompt.draft("expresser", _said_fallbacks(rng, _pick(task.answers, it)))]

            prompt = Prompt()
            prompt.add("system").text(PIPELINE_SYSTEMS["reviewer"])
            prompt.add("user").text("Task: ").quote(task.question, QUESTION).text("\n\nPlan:\n").said(plan) \
                .text("\n\nAnswer:\n").said(answer).text("\n\nReview the answer.")
            review_text = task.reviews[-1] if it == iterations - 1 else _pick(task.reviews, it)
            [review] = yield [prompt.draft("reviewer", _said_fallbacks(rng, review_text))]
    return run


def pipeline_trace() -> TraceSpec:
    rng = random.Random("pipeline")
    name = "plan_execute_review"
    specs = [SessionSpec(name, "default", f"s{i + 1}", pipeline_session(task, iterations), openai_headers("custom"))
             for i, (task, iterations) in enumerate(zip(PIPELINE_TASKS, (3, 2, 2)))]
    return TraceSpec(name, "A sequential Planner -> Executor -> Expresser -> Reviewer loop over 2-3 iterations; the "
                     "planner reads its previous plan and the reviewer's feedback.", staggered(specs, rng))


# --------------------------------------------------------------------------------------
# AutoGen group chat: the transcript with other agents' turns as named user messages and
# one's own turns as assistant messages; optionally a selector (GroupChatManager) call
# before every turn, whose answer is just the next speaker's name.
# --------------------------------------------------------------------------------------

AUTOGEN_SYSTEMS = {
    "Product_manager": "You are the Product_manager. Turn the user's request into clear requirements and acceptance "
                       "criteria for the Engineer. Keep it short and do not write code.",
    "Engineer": "You are the Engineer. Write the code that meets the requirements discussed in the chat. Put the "
                "code in a single fenced block and keep explanations brief.",
    "Critic": "You are the Critic. Review the Engineer's work against the requirements, point out bugs and missing "
              "cases, and say clearly whether the work is acceptable.",
}
AUTOGEN_ORDER = ("Product_manager", "Engineer", "Critic", "Engineer", "Critic")
SELECTOR_SYSTEM = (
    "You are in a role play game. The following roles are available:\n"
    + "\n".join(f"{name}: {text}" for name, text in AUTOGEN_SYSTEMS.items())
    + "\n\nRead the following conversation.\nThen select the next role from ['Product_manager', 'Engineer', "
      "'Critic'] to play. Only return the role.")
SELECTOR_PROMPT = ("Read the above conversation. Then select the next role from ['Product_manager', 'Engineer', "
                   "'Critic'] to play. Only return the role.")

AUTOGEN_TASKS = (
    ("Build a small command-line tool in Python that counts word frequencies in a text file and prints the ten "
     "most common words with their counts.", (
        "Requirements: read a file path from the command line, count words case-insensitively, ignore "
        "punctuation, print the top ten as 'word count' lines. Acceptance: works on an empty file.",
        "```python\nimport sys, re, collections\nwords = re.findall(r\"[a-z']+\", open(sys.argv[1]).read().lower())\n"
        "for word, n in collections.Counter(words).most_common(10):\n    print(word, n)\n```",
        "The file is never closed and a missing argument crashes with IndexError. Use a with block and print a "
        "usage message. Otherwise it meets the requirements.",
        "```python\nimport sys, re, collections\nif len(sys.argv) != 2:\n    sys.exit('usage: wordfreq FILE')\n"
        "with open(sys.argv[1]) as f:\n    words = re.findall(r\"[a-z']+\", f.read().lower())\n"
        "for word, n in collections.Counter(words).most_common(10):\n    print(word, n)\n```",
        "Acceptable now: the file is closed, the usage message is clear and an empty file prints nothing. "
        "TERMINATE")),
    ("Design a REST endpoint for a to-do app that lets a user mark several tasks as done in one request; describe "
     "the request and response bodies.", (
        "Requirements: one PATCH call for up to 100 task ids, all-or-nothing semantics, return the updated tasks. "
        "Acceptance: unknown ids produce a 404 listing them.",
        "PATCH /tasks/bulk with body {\"ids\": [1, 2, 3], \"done\": true}. Response 200: {\"tasks\": [...]}. "
        "Response 404: {\"missing\": [2]}. The update runs in one transaction.",
        "Missing: the limit of 100 ids is not enforced and there is no 422 for an empty list. Also say what "
        "happens to tasks owned by another user.",
        "Updated: reject more than 100 ids or an empty list with 422; ids owned by someone else count as missing "
        "and produce the 404; everything runs in one transaction.",
        "Acceptable. Limits, ownership and the all-or-nothing rule are covered. TERMINATE")),
    ("Write a SQL query that returns, for each customer, the date of their most recent order and the total amount "
     "they spent in 2023.", (
        "Requirements: one row per customer, including customers with no orders in 2023 (total 0). Columns: "
        "customer_id, last_order_date, total_2023.",
        "```sql\nSELECT c.id, MAX(o.created_at), SUM(o.amount)\nFROM customers c JOIN orders o ON o.customer_id = "
        "c.id\nWHERE o.created_at >= '2023-01-01'\nGROUP BY c.id;\n```",
        "The inner join and the WHERE clause drop customers without 2023 orders, and last_order_date should not be "
        "limited to 2023. Use a LEFT JOIN with a conditional sum.",
        "```sql\nSELECT c.id AS customer_id, MAX(o.created_at) AS last_order_date,\n  COALESCE(SUM(o.amount) "
        "FILTER (WHERE o.created_at >= '2023-01-01' AND o.created_at < '2024-01-01'), 0) AS total_2023\nFROM "
        "customers c LEFT JOIN orders o ON o.customer_id = c.id\nGROUP BY c.id;\n```",
        "Acceptable: every customer appears, the last order date is unrestricted and the 2023 total defaults to "
        "0. TERMINATE")),
)


def _transcript(prompt: Prompt, question: str, turns: list[Said], me: str | None) -> None:
    prompt.add("user", name="user").quote(question, QUESTION)
    for said in turns:
        if said.agent == me:
            prompt.add("assistant").said(said)
        else:
            prompt.add("user", name=said.agent).said(said)


def autogen_session(question: str, texts: Sequence[str], selector: bool) -> Callable[[random.Random], SessionRun]:
    def run(rng: random.Random) -> SessionRun:
        turns: list[Said] = []
        for speaker, text in zip(AUTOGEN_ORDER, texts):
            if selector:
                prompt = Prompt()
                prompt.add("system").text(SELECTOR_SYSTEM)
                _transcript(prompt, question, turns, None)
                prompt.add("system").text(SELECTOR_PROMPT)
                yield [prompt.draft("chat_manager", [], fixed=speaker)]
            prompt = Prompt()
            prompt.add("system").text(AUTOGEN_SYSTEMS[speaker])
            _transcript(prompt, question, turns, speaker)
            [said] = yield [prompt.draft(speaker, _said_fallbacks(rng, text))]
            turns.append(said)
    return run


def autogen_trace(selector: bool) -> TraceSpec:
    name = "autogen_groupchat_selector" if selector else "autogen_groupchat"
    rng = random.Random("autogen")  # the same sessions in both traces; the selector only adds its calls
    specs = [SessionSpec(name, "default", f"s{i + 1}", autogen_session(question, texts, selector),
                         openai_headers("autogen"))
             for i, (question, texts) in enumerate(AUTOGEN_TASKS)]
    extra = (" plus a GroupChatManager speaker-selection call before every turn (transcript + trailing system "
             "prompt; its answer is a bare role name)") if selector else ""
    return TraceSpec(name, "AutoGen group chat (Product_manager, Engineer, Critic): each speaker gets the transcript "
                     "with the task as user 'user', other agents as named user messages and its own turns as "
                     f"assistant messages{extra}.", staggered(specs, rng))


# --------------------------------------------------------------------------------------
# Two help desks (X-Client-Id) with the same agent names, near-identical prompts and some
# identical customer messages, interleaved: nothing may cross from one app to the other.
# --------------------------------------------------------------------------------------


def helpdesk_systems(company: str) -> dict[str, str]:
    return {
        "Triage": f"You are the triage agent of the {company} help desk. Read the customer's message, name its "
                  "category (billing, technical, account) and summarise the problem in one sentence.",
        "Specialist": f"You are a support specialist at {company}. Write a helpful, polite reply to the customer "
                      "that solves their problem or tells them exactly what happens next.",
        "Reviewer": f"You are the quality reviewer of the {company} help desk. Check the draft reply for accuracy, "
                    "tone and missing steps, and say whether it can be sent.",
    }


TICKETS = {
    "refund": ("Hi, I was charged twice for my March subscription (order #48213). Can you refund the duplicate "
               "payment? Thanks, Dana",
               ("Category: billing. The customer was charged twice for the March subscription and wants the "
                "duplicate refunded.",
                "Hi Dana, sorry about the double charge on order #48213. I have refunded the duplicate payment; it "
                "will reach your card within 5 business days.",
                "Can be sent. The reply confirms the refund and gives a time frame; consider adding the refund "
                "reference number.")),
    "wifi": ("My router keeps dropping the Wi-Fi connection every evening around 9 pm. I have already restarted it "
             "twice. What else can I try?",
             ("Category: technical. The customer's Wi-Fi drops every evening at about 9 pm despite two restarts.",
              "Thanks for the details. Please update the router firmware and switch to channel 1, 6 or 11; evening "
              "drops are often interference. If it continues, we will send a technician.",
              "Mostly good, but add how to reach the firmware page and ask for the router model before promising a "
              "technician.")),
    "email": ("I'd like to change the email address on my account from j.ortega@example.com to "
              "jortega.work@example.com, but the settings page gives me an error.",
              ("Category: account. The customer cannot change the account email address because the settings page "
               "fails.",
               "I am sorry the settings page failed. I have started the change for you: please confirm it with the "
               "link we just sent to jortega.work@example.com.",
               "Can be sent. It fixes the problem and explains the confirmation step clearly.")),
    "invoices": ("How do I export all my invoices from last year as a single PDF? I need them for my tax return.",
                 ("Category: billing. The customer wants last year's invoices exported as one PDF for taxes.",
                  "You can do this under Billing, then Invoices: pick last year in the date filter and choose "
                  "Export as PDF. All invoices land in one file.",
                  "Can be sent. The steps are correct; mention that the export may take a minute.")),
}


def helpdesk_session(systems: dict[str, str], ticket: str) -> Callable[[random.Random], SessionRun]:
    message, (triage_text, reply_text, review_text) = TICKETS[ticket]

    def run(rng: random.Random) -> SessionRun:
        prompt = Prompt()
        prompt.add("system").text(systems["Triage"])
        prompt.add("user").quote(message, QUESTION)
        yield [prompt.draft("Triage", _said_fallbacks(rng, triage_text))]
        prompt = Prompt()  # the router picked this specialist; it reads the customer's message only
        prompt.add("system").text(systems["Specialist"])
        prompt.add("user").quote(message, QUESTION)
        [draft] = yield [prompt.draft("Specialist", _said_fallbacks(rng, reply_text))]
        prompt = Prompt()
        prompt.add("system").text(systems["Reviewer"])
        prompt.add("user").text("Customer message:\n").quote(message, QUESTION).text("\n\nDraft reply:\n").said(draft)
        yield [prompt.draft("Reviewer", _said_fallbacks(rng, review_text))]
    return run


def two_apps_trace() -> TraceSpec:
    rng = random.Random("two-apps")
    name = "two_apps_helpdesk"
    apps = {"acme-helpdesk": ("Acme", ("refund", "wifi", "email")),
            "globex-helpdesk": ("Globex", ("refund", "wifi", "invoices"))}
    specs = []
    for app, (company, tickets) in apps.items():
        for i, ticket in enumerate(tickets):
            specs.append(SessionSpec(name, app, f"s{i + 1}", helpdesk_session(helpdesk_systems(company), ticket),
                                     {**openai_headers("helpdesk"), "x-client-id": app}))
    return TraceSpec(name, "Two help-desk apps (X-Client-Id) with the same agents (Triage, Specialist, Reviewer), "
                     "prompts that differ only in the company name and two identical customer messages, interleaved. "
                     "The Specialist reads no other agent's answer, so its predecessor is a succession edge.",
                     staggered(specs, rng, spread=3))


# --------------------------------------------------------------------------------------
# The suite and the command line.
# --------------------------------------------------------------------------------------


def all_traces() -> list[TraceSpec]:
    scenes = list(SCENES)
    return [
        kvcomm_trace(2, 3, 3, frozenset({"critic"}), 0),
        kvcomm_trace(3, 3, 2, frozenset({"expert"}), 0),
        kvcomm_trace(4, 2, 3, frozenset({"mathematician"}), 0),
        kvcomm_trace(5, 2, 2, frozenset({"critic", "scientist"}), 0),
        gather_trace("allgather_ttsep", True, [(3, 3), (5, 3), (10, 2)], scenes[:3]),
        gather_trace("allgather_plain", False, [(4, 3), (6, 2), (8, 2)], scenes[3:]),
        react_trace(),
        reflexion_trace(),
        pipeline_trace(),
        autogen_trace(selector=False),
        autogen_trace(selector=True),
        two_apps_trace(),
    ]


def generate(out_dir: Path, mode: OutputMode, cache_only: bool = False, only: set[str] | None = None) -> list[Path]:
    traces = [t for t in all_traces() if only is None or t.name in only]
    answerer = Answerer(mode, cache_only)
    records = drive(traces, answerer)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [write_trace(t, records[t.name], out_dir) for t in traces]
    if answerer.model is not None and not cache_only and only is None:
        answerer.model.save()
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", choices=("model", "template"), default="model",
                        help="agents' answers: SmolLM2 on CPU (cached) or hand-written templates")
    parser.add_argument("--out", type=Path, default=HERE, help="where the .jsonl files go (default: next to this file)")
    parser.add_argument("--cache-only", action="store_true", help="never load the model: fail on an uncached answer")
    parser.add_argument("--trace", action="append", help="only this trace (repeatable)")
    args = parser.parse_args(argv)
    paths = generate(args.out, args.outputs, args.cache_only, set(args.trace) if args.trace else None)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
