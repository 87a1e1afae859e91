"""AutoGen AgentChat AssistantAgent with three Python tools and reflect_on_tool_use=True:
the (scripted) tool calls run in AutoGen, their results go back to the model as tool
messages, and the model writes the answer. Each run has two user turns on the same
agent, so the second turn's prompt carries the first turn's tool calls, results and
answer again. Tool results are short ("214", "911.872") and long (a policy text)."""

from __future__ import annotations

import asyncio

from autogen_agentchat.agents import AssistantAgent

from _autogen import model_client
from _common import RecorderClient, Run, parse_args, tool_call

APP = "autogen_tool"
AGENT = "shop_assistant"
SYSTEM = "You are a shop assistant. Use the tools, then answer the customer in one or two sentences."
STOCK = {"blue mug": 214, "teapot": 37, "green scarf": 5}
POLICIES = {
    "returns": ("Items can be returned within 30 days of delivery if unused and in the original box. "
                "Mugs and teapots that arrive broken are replaced for free; send a photo of the damage "
                "within 7 days. Refunds go back to the original payment method within 5 working days."),
    "shipping": ("Orders over 40 euros ship free within the EU. Standard delivery takes 3 to 5 working days; "
                 "express delivery (9 euros) takes 1 to 2. Fragile items are double boxed."),
}


def count_stock(item: str) -> str:
    """How many units of an item are in stock."""
    return str(STOCK.get(item, 0))


def convert_price(amount: float, rate: float) -> str:
    """Convert an amount of euros at the given exchange rate."""
    return f"{amount * rate:.3f}"


def lookup_policy(topic: str) -> str:
    """The shop's policy text on a topic (returns, shipping)."""
    return POLICIES.get(topic, "No policy found.")


TASKS = [
    "How many blue mugs are in stock, and what do 800 euros cost in dollars at a rate of 1.13984?",
    "What is your shipping policy?",
    "Do you still have green scarves?",
]
RUNS = [Run("r1", TASKS[0]), Run("r2", TASKS[1], "g1"), Run("r3", TASKS[2], "g1"), Run("r4", TASKS[0])]
FOLLOW_UPS = {
    TASKS[0]: "Can I return a mug if it arrives broken?",
    TASKS[1]: "Summarise that in one short sentence.",
    TASKS[2]: "And how many teapots?",
}
# Per task, the agent's requests in order: scripted tool calls, or None where the model answers.
SCRIPTS = {
    TASKS[0]: [{"tool_calls": [{"name": "count_stock", "arguments": {"item": "blue mug"}},
                               {"name": "convert_price", "arguments": {"amount": 800, "rate": 1.13984}}]},
               None, tool_call("lookup_policy", topic="returns"), None],
    TASKS[1]: [tool_call("lookup_policy", topic="shipping"), None, None],
    TASKS[2]: [tool_call("count_stock", item="green scarf"), None, tool_call("count_stock", item="teapot"), None],
}


async def one_run(recorder: RecorderClient, run: Run) -> None:
    recorder.script(run.run, AGENT, SCRIPTS[run.task])
    agent = AssistantAgent(AGENT, model_client(recorder.base_url(run.run, AGENT)), system_message=SYSTEM,
                           tools=[count_stock, convert_price, lookup_policy], reflect_on_tool_use=True)
    await agent.run(task=run.task)
    await agent.run(task=FOLLOW_UPS[run.task])


async def main() -> None:
    recorder, out = parse_args(APP)
    for run in RUNS:
        recorder.register_run(run)
    await one_run(recorder, RUNS[0])
    await asyncio.gather(one_run(recorder, RUNS[1]), one_run(recorder, RUNS[2]))
    await one_run(recorder, RUNS[3])
    print(recorder.save("autogen-agentchat", __doc__.split("\n\n")[0].replace("\n", " "), out))


if __name__ == "__main__":
    asyncio.run(main())
