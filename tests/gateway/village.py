"""An All-Gather village through a fake upstream: three villagers answer the council's
question, then each round every villager reads all of the last round's answers,
shuffled. The traffic of the restart and replica tests."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import openai

from kvrelay.wire.plan import SegmentPlan, read_plan

QUESTION = "The town council asks: should the old mill by the river become a library or a bakery?"
NUM_AGENTS = 3


class Round(NamedTuple):
    plans: list[SegmentPlan]  # as the upstream received them, one per villager
    bodies: list[dict[str, Any]]
    answers: list[str]


def clients_for(gateways: Sequence[Any]) -> list[openai.OpenAI]:
    return [openai.OpenAI(base_url=g.v1, api_key="unused", max_retries=0) for g in gateways]


def village_round(clients: Sequence[openai.OpenAI], fake: Any, r: int, outputs: list[str], rng: random.Random,
                  headers: dict[str, str] | None = None, before_each: Callable[[], None] | None = None) -> Round:
    """Round `r`: villager i's request goes to clients[(r * NUM_AGENTS + i) % len(clients)]
    (round-robin over gateways across rounds); `before_each` runs before every request."""
    plans, bodies, answers = [], [], []
    for i in range(NUM_AGENTS):
        shown = outputs[:]
        rng.shuffle(shown)
        user = QUESTION if r == 0 else "What your neighbours said:\n\n" + "\n\n".join(shown)
        fake.behaviour.pieces = [f"Round {r}, villager {i}: I have listened, and I now argue that the mill "
                                 f"should become a {('library', 'bakery')[(i + r) % 2]} for the whole town."]
        messages = [{"role": "system", "content": f"You are villager {i} of a small river town; you speak plainly."},
                    {"role": "user", "content": user}]
        if before_each is not None:
            before_each()
        client = clients[(r * NUM_AGENTS + i) % len(clients)]
        answer = client.chat.completions.create(model="fake", messages=messages, extra_headers=headers or {})
        answers.append(answer.choices[0].message.content or "")
        bodies.append(fake.received[-1].body)
        plans.append(read_plan(bodies[-1]))
    return Round(plans, bodies, answers)
