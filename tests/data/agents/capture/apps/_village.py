"""The Generative-Agents style All-Gather village both village apps run, plain `openai`
client code. Round 1: every villager states a plan from its persona. From round 2 on,
every villager reads ALL of the previous round's answers, in an order of its own,
joined by the app's separator. A round's villagers are asked concurrently (threads);
the round number is in the tag. Both apps use the same persona system prompts."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from openai import OpenAI

from _common import API_KEY, MAX_TOKENS, MODEL, TEMPERATURE, RecorderClient, Run

PERSONAS = {
    "isabella": "You are Isabella Rodriguez, the owner of Hobbs Cafe. You are warm, organised and love hosting.",
    "klaus": "You are Klaus Mueller, a sociology student writing a paper on gentrification. You are curious.",
    "maria": "You are Maria Lopez, a physics student who streams games in the evening. You are cheerful.",
    "tom": "You are Tom Moreno, who runs the village grocery with his wife. You are practical and busy.",
    "ayesha": "You are Ayesha Khan, a literature student writing about Shakespeare. You are thoughtful.",
    "sam": "You are Sam Moore, a retired navy officer running for mayor. You are friendly and talkative.",
    "jennifer": "You are Jennifer Moore, a watercolour painter who teaches art classes. You are calm.",
    "eddy": "You are Eddy Lin, a music student composing a piece for his class. You are dreamy.",
    "carmen": "You are Carmen Ortiz, who runs the village shop and knows everyone. You are chatty.",
    "rajiv": "You are Rajiv Patel, a poet who works at the library. You are quiet and observant.",
}
ROUND_TIMES = ["8:00 am", "12:00 pm", "5:00 pm"]
TASKS = [
    "Isabella is hosting a Valentine's Day party at Hobbs Cafe tonight at 5 pm.",
    "The village library is collecting books for a charity sale this weekend.",
    "A storm is expected this evening and the market square must be cleared.",
]


@dataclass(frozen=True)
class VillageRun:
    run: Run
    villagers: int
    rounds: int


def first_round_prompt(task: str) -> str:
    return f"News in the village: {task}\nIt is {ROUND_TIMES[0]}. State your plan for today in one or two sentences."


def later_round_prompt(task: str, round_: int, heard: str) -> str:
    return (f"News in the village: {task}\nIt is {ROUND_TIMES[round_ - 1]}. This is what everyone said last time:\n\n"
            f"{heard}\n\nWhat do you do next? Answer in one or two sentences.")


def heard_order(run: str, agent: str, round_: int, names: list[str]) -> list[str]:
    """The order one villager reads the last round's answers in: its own, and the same
    on every capture (seeded by run, villager and round)."""
    order = list(names)
    random.Random(f"{run}/{agent}/{round_}").shuffle(order)
    return order


def ask(recorder: RecorderClient, run: str, agent: str, round_: int, prompt: str, system: str | None = None,
        max_tokens: int = MAX_TOKENS) -> str:
    """One villager's turn: its persona (`system`; PERSONAS' by default) and the prompt."""
    client = OpenAI(base_url=recorder.base_url(run, agent, round_), api_key=API_KEY)
    reply = client.chat.completions.create(
        model=MODEL, temperature=TEMPERATURE, max_tokens=max_tokens,
        messages=[{"role": "system", "content": system or PERSONAS[agent]}, {"role": "user", "content": prompt}])
    return reply.choices[0].message.content or ""


def one_run(recorder: RecorderClient, village: VillageRun, separator: str) -> None:
    run, names = village.run, list(PERSONAS)[:village.villagers]
    previous: dict[str, str] = {}
    with ThreadPoolExecutor(len(names)) as pool:
        for round_ in range(1, village.rounds + 1):
            prompts = {}
            for agent in names:
                if round_ == 1:
                    prompts[agent] = first_round_prompt(run.task)
                else:
                    heard = separator.join(f"{a}: {previous[a]}" for a in heard_order(run.run, agent, round_, names))
                    prompts[agent] = later_round_prompt(run.task, round_, heard)
            futures = {agent: pool.submit(ask, recorder, run.run, agent, round_, prompts[agent]) for agent in names}
            previous = {agent: future.result() for agent, future in futures.items()}


def run_village(recorder: RecorderClient, runs: list[VillageRun], separator: str) -> None:
    """The first run alone, the two middle ones concurrently, the last alone."""
    for village in runs:
        recorder.register_run(village.run)
    one_run(recorder, runs[0], separator)
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(one_run, recorder, village, separator) for village in runs[1:3]]:
            future.result()
    one_run(recorder, runs[3], separator)
