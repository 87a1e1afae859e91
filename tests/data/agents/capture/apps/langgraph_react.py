"""LangGraph's prebuilt create_react_agent with two tools: the (scripted) tool calls run
in LangGraph's ToolNode, their results go back as tool messages on every later step,
and the model writes the final answer. One run asks for both tools at once (parallel
tool calls)."""

from __future__ import annotations

import asyncio

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langgraph.prebuilt import create_react_agent

from _common import RecorderClient, Run, parse_args, tool_call
from _langchain import chat_model

APP = "langgraph_react"
AGENT = "travel_agent"
SYSTEM = "You are a travel assistant. Use the tools when they help, then answer briefly."
WEATHER = {
    "Oslo": "Light rain, 9 degrees C, wind 20 km/h from the west; clearing in the evening.",
    "Rome": "Sunny, 24 degrees C, light breeze; no rain expected this week.",
    "Lima": "Overcast, 17 degrees C, humid; drizzle possible in the morning.",
}
RATES = {("EUR", "NOK"): 11.62, ("EUR", "USD"): 1.0815, ("USD", "PEN"): 3.7521}


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return WEATHER.get(city, "No weather data.")


@tool
def convert_currency(amount: float, source: str, target: str) -> str:
    """Convert an amount from one currency to another."""
    return f"{amount * RATES[(source, target)]:.2f}"


TASKS = [
    "I am going to Oslo with 200 euros. What is the weather, and how much is that in Norwegian kroner?",
    "What is the weather in Rome, and what are 150 euros in US dollars?",
    "Is it raining in Lima? Also convert 80 US dollars to Peruvian soles.",
]
RUNS = [Run("r1", TASKS[0]), Run("r2", TASKS[1], "g1"), Run("r3", TASKS[2], "g1"), Run("r4", TASKS[0])]
SCRIPTS = {
    TASKS[0]: [tool_call("get_weather", city="Oslo"),
               tool_call("convert_currency", amount=200, source="EUR", target="NOK"), None],
    TASKS[1]: [{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}},
                               {"name": "convert_currency",
                                "arguments": {"amount": 150, "source": "EUR", "target": "USD"}}]}, None],
    TASKS[2]: [tool_call("get_weather", city="Lima"),
               tool_call("convert_currency", amount=80, source="USD", target="PEN"), None],
}


async def one_run(recorder: RecorderClient, run: Run) -> None:
    recorder.script(run.run, AGENT, SCRIPTS[run.task])
    agent = create_react_agent(chat_model(recorder.base_url(run.run, AGENT)), [get_weather, convert_currency],
                               prompt=SYSTEM)
    await agent.ainvoke({"messages": [HumanMessage(run.task)]})


async def main() -> None:
    recorder, out = parse_args(APP)
    for run in RUNS:
        recorder.register_run(run)
    await one_run(recorder, RUNS[0])
    await asyncio.gather(one_run(recorder, RUNS[1]), one_run(recorder, RUNS[2]))
    await one_run(recorder, RUNS[3])
    print(recorder.save("langgraph", __doc__.split("\n\n")[0].replace("\n", " "), out))


if __name__ == "__main__":
    asyncio.run(main())
