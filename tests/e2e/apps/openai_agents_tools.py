"""The OpenAI Agents SDK (Agent + function_tool on a Chat Completions model) with two real
Python tools, run against a kvrelay gateway: the proof that the SDK's run loop (call,
execute, run the model again) ends with a final output on the default model. Once with
Runner.run and once with Runner.run_streamed (SSE tool_call deltas). Runs in the agents
venv (frameworks + stdlib only); prints one JSON line.

    .venv-agents/bin/python tests/e2e/apps/openai_agents_tools.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    RunResult,
    RunResultStreaming,
    ToolCallItem,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

import _tools
from _tools import INVOCATIONS, MODEL, parse_args

QUESTION = "What is the weather in Tokyo?"
MAX_TURNS = 4  # a loop that never answers fails fast (MaxTurnsExceeded) instead of after 10 model calls


get_weather = function_tool(_tools.get_weather)
multiply = function_tool(_tools.multiply)


def _summary(result: RunResult | RunResultStreaming, streaming: bool, start: int) -> dict[str, Any]:
    requested = [{"name": item.raw_item.name, "arguments": item.raw_item.arguments}
                 for item in result.new_items if isinstance(item, ToolCallItem)
                 and hasattr(item.raw_item, "arguments")]
    final = result.final_output
    return {"streaming": streaming, "requested": requested, "invocations": INVOCATIONS[start:],
            "final_answer": final if isinstance(final, str) else repr(final),
            "item_types": [type(item).__name__ for item in result.new_items]}


async def run_once(agent: Agent[Any], streaming: bool) -> dict[str, Any]:
    """One run, unary or streamed; a run the model never ends (it only calls tools) is
    reported, with the calls it made, instead of a traceback."""
    start = len(INVOCATIONS)
    try:
        if streaming:
            result: RunResult | RunResultStreaming = Runner.run_streamed(agent, QUESTION, max_turns=MAX_TURNS)
            async for _ in result.stream_events():
                pass  # the SDK assembles the items; the events themselves are not needed here
        else:
            result = await Runner.run(agent, QUESTION, max_turns=MAX_TURNS)
    except MaxTurnsExceeded as exc:
        return {"streaming": streaming, "requested": [], "invocations": INVOCATIONS[start:], "final_answer": "",
                "item_types": [], "error": f"MaxTurnsExceeded: {exc}"}
    return _summary(result, streaming, start)


async def main(base_url: str, max_tokens: int) -> dict[str, Any]:
    set_tracing_disabled(True)  # no trace export to OpenAI's servers
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    agent = Agent(name="assistant", instructions="Use the tools, then answer in one short sentence.",
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=max_tokens), tools=[get_weather, multiply])
    try:
        runs = [await run_once(agent, streaming) for streaming in (False, True)]
    finally:
        await client.close()
    return {"app": "openai_agents_tools", "runs": runs, "invocations": INVOCATIONS,
            "final_answer": runs[-1]["final_answer"]}


if __name__ == "__main__":
    args = parse_args(__doc__)
    print(json.dumps(asyncio.run(main(args.base_url, args.max_tokens))), flush=True)
