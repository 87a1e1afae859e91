"""`kvrelay bench faithful`: the product path against the engine alone, with defaults.

A user points an agent app at the gateway and changes nothing else, so that is what is
measured: `kvrelay up` with every default, against `kvrelay engine` with every default
(the engine alone, plain prefix caching, no plans), both real processes on loopback, the
same greedy multi-agent app run through the official openai client against each, with
no session or agent headers. The app is two workflows of SmolLM2-sized agents:

- a round-robin group chat: three agents take turns, each reading the task and every
  earlier turn (its own as assistant messages, the others' as user messages);
- a three-node pipeline: a researcher's notes go to a writer, whose draft goes to an
  editor.

The app runs twice on each stack (cold, then warm caches). Reported: how many answers
are token-for-token what the engine alone answered (greedy: they must all be), the
prompt tokens each stack computed (prompt minus cached, from the usage each returned),
and the wall time of the whole app on each.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.common import BenchResult, free_port
from benchmarks.stack import Service

MODEL = "m"
MAX_TOKENS = 32
TASKS = ("Plan a three-day trip to Lisbon in May for two friends who like food and old streets.",
         "Write a short guide to starting a vegetable garden on a small city balcony.")
AGENTS = {
    "planner": "You are the planner of a small team. Break the task into concrete steps, name who does what, "
               "and keep every step short. You never write the final text yourself; you organise the work. "
               "Answer in at most three sentences.",
    "critic": "You are the critic of a small team. Read what the others wrote, find the weakest point, and say "
              "plainly how to fix it. You are kind but direct, and you never repeat what was already said. "
              "Answer in at most three sentences.",
    "writer": "You are the writer of a small team. Turn the plan and the critique into clear, friendly prose for "
              "the reader. Prefer short sentences and concrete details over general advice. "
              "Answer in at most three sentences.",
}
STAGES = {
    "researcher": ("You are a careful researcher. List the facts a writer needs for the task, one per line, "
                   "with no commentary.", "Task:\n"),
    "drafter": ("You are a writer. Turn the notes you are given into a short, friendly paragraph for a "
                "general reader.", "Notes:\n"),
    "editor": ("You are an editor. Tighten the draft you are given: cut filler, fix errors, keep the voice.",
               "Draft:\n"),
}


class Answer(NamedTuple):
    text: str
    prompt_tokens: int
    cached_tokens: int

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached_tokens


Ask = Callable[[list[dict[str, str]]], Answer]


def group_chat(ask: Ask, task: str, rounds: int) -> list[Answer]:
    """Round-robin turns; each agent sees the task and every turn so far."""
    turns: list[tuple[str, str]] = []
    answers = []
    for _ in range(rounds):
        for name, system in AGENTS.items():
            messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
            messages += [{"role": "assistant" if speaker == name else "user", "content": text}
                         for speaker, text in turns]
            answer = ask(messages)
            answers.append(answer)
            turns.append((name, answer.text))
    return answers


def pipeline(ask: Ask, task: str) -> list[Answer]:
    """Researcher -> drafter -> editor, each reading the previous stage's output."""
    answers = []
    text = task
    for system, lead in STAGES.values():
        answer = ask([{"role": "system", "content": system}, {"role": "user", "content": lead + text}])
        answers.append(answer)
        text = answer.text
    return answers


def run_app(ask: Ask, quick: bool) -> list[Answer]:
    answers = group_chat(ask, TASKS[0], rounds=2 if quick else 3)
    for task in TASKS[: 1 if quick else 2]:
        answers += pipeline(ask, task)
    return answers


def client_ask(base_url: str) -> Ask:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    def ask(messages: list[dict[str, str]]) -> Answer:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                               temperature=0)
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return Answer(reply.choices[0].message.content or "", usage.prompt_tokens, cached or 0)

    return ask


class Comparison(NamedTuple):
    gateway: list[Answer]
    engine: list[Answer]
    gateway_s: float
    engine_s: float

    @property
    def matched(self) -> int:
        return sum(g.text == e.text for g, e in zip(self.gateway, self.engine))


def compare(model: str | None, quick: bool, log_dir: Path, passes: int = 2) -> Comparison:
    """Start both stacks with defaults, warm each with one unrelated request, then run
    the app `passes` times on each, one stack at a time (they share the cores)."""
    model_args = ["--model", model] if model else []
    db = f"sqlite+aiosqlite:///{log_dir / 'gateway.sqlite'}"
    gateway = Service("up", ["up", *model_args, "--served-model-name", MODEL, "--engine-port", str(free_port()),
                             "--database-url", db, "--log-level", "warning"], {}, log_dir)
    engine = Service("engine", ["engine", *model_args, "--served-model-name", MODEL, "--log-level", "warning"], {},
                     log_dir)
    try:
        gateway.start(timeout=300)
        engine.start(timeout=300)
        results: dict[str, list[Answer]] = {"gateway": [], "engine": []}
        seconds = {"gateway": 0.0, "engine": 0.0}
        asks = {"gateway": client_ask(gateway.url), "engine": client_ask(engine.url)}
        for ask in asks.values():
            ask([{"role": "user", "content": "Say hello."}])
        for _ in range(passes):
            for name, ask in asks.items():
                started = time.perf_counter()
                results[name] += run_app(ask, quick)
                seconds[name] += time.perf_counter() - started
        return Comparison(results["gateway"], results["engine"], seconds["gateway"], seconds["engine"])
    finally:
        gateway.stop()
        engine.stop()


def run(quick: bool = False, model: str | None = None) -> BenchResult:
    with tempfile.TemporaryDirectory(prefix="kvrelay-faithful-") as tmp:
        result = compare(model, quick, Path(tmp))
    total = len(result.engine)
    computed_gw = sum(a.computed for a in result.gateway)
    computed_engine = sum(a.computed for a in result.engine)
    prompt_tokens = sum(a.prompt_tokens for a in result.engine)
    metrics: dict[str, float] = {
        "answers": float(total),
        "greedy_match": result.matched / total,
        "computed_tokens_gateway": float(computed_gw),
        "computed_tokens_engine": float(computed_engine),
        "computed_token_ratio": computed_gw / max(computed_engine, 1),
        "wall_s_gateway": result.gateway_s,
        "wall_s_engine": result.engine_s,
        "wall_ratio": result.gateway_s / result.engine_s,
    }
    rows = [
        ("answers identical to the engine alone", f"{result.matched} / {total}", f"{total} / {total}",
         f"{metrics['greedy_match']:.3f}"),
        ("prompt tokens computed (of all prompt tokens)", f"{computed_gw} ({prompt_tokens})",
         f"{computed_engine} ({prompt_tokens})", f"{metrics['computed_token_ratio']:.3f}"),
        ("wall time of the app, s", f"{result.gateway_s:.1f}", f"{result.engine_s:.1f}", f"{metrics['wall_ratio']:.3f}"),
    ]
    config: dict[str, Any] = {"quick": quick, "model": model or "default (SmolLM2-135M-Instruct)",
                              "max_tokens": MAX_TOKENS, "passes": 2, "stacks": "kvrelay up vs kvrelay engine, defaults"}
    return BenchResult("faithful", metrics, config, rows,
                       ("measure", "kvrelay up (gateway)", "engine alone", "gateway/engine"))
