"""An AutoGen AgentChat AssistantAgent with two real Python tools, run against a kvrelay
gateway: the proof that AutoGen's tool loop (call, execute, reflect) completes on the
default model. Runs in the agents venv (frameworks + stdlib only); prints one JSON line:
the tool calls the model requested, the invocations the tools themselves recorded, the
final answer of each task and the message types AutoGen produced.

    .venv-agents/bin/python tests/e2e/apps/autogen_tools.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.messages import ToolCallExecutionEvent, ToolCallRequestEvent
from autogen_core.models import ModelInfo
from autogen_ext.models.openai import OpenAIChatCompletionClient

import _tools
from _tools import INVOCATIONS, MODEL, parse_args

SYSTEM = "You are a helpful assistant. Use the tools, then answer in one short sentence."
TASKS = ["What is the weather in Paris?", "What is 6 times 7?"]
# What the model can do on this endpoint: the engine supports tools and JSON output
# (grammar-constrained); "unknown" is the honest family for SmolLM2.
SMOLLM2_INFO = ModelInfo(vision=False, function_calling=True, json_output=True, family="unknown",
                         structured_output=True, multiple_system_messages=False)


get_weather, multiply = _tools.get_weather, _tools.multiply


async def main(base_url: str, max_tokens: int) -> dict[str, Any]:
    client = OpenAIChatCompletionClient(model=MODEL, base_url=base_url, api_key="unused", model_info=SMOLLM2_INFO,
                                        temperature=0, max_tokens=max_tokens)
    agent = AssistantAgent("assistant", client, system_message=SYSTEM, tools=[get_weather, multiply],
                           reflect_on_tool_use=True)
    requested: list[dict[str, Any]] = []
    answers: list[str] = []
    types: list[str] = []
    tool_errors: list[str] = []  # a call AutoGen could not run (bad arguments, unknown tool)
    try:
        for task in TASKS:  # two user turns on one agent: the second prompt carries the first's calls
            result = await agent.run(task=task)
            for message in result.messages:
                types.append(type(message).__name__)
                if isinstance(message, ToolCallRequestEvent):
                    requested += [{"name": c.name, "arguments": c.arguments} for c in message.content]
                if isinstance(message, ToolCallExecutionEvent):
                    tool_errors += [r.content for r in message.content if r.is_error]
            final = result.messages[-1]
            answers.append(final.content if isinstance(final.content, str) else repr(final.content))
    finally:
        await client.close()
    return {"app": "autogen_tools", "requested": requested, "invocations": INVOCATIONS, "answers": answers,
            "tool_errors": tool_errors, "final_answer": answers[-1] if answers else "", "message_types": types}


if __name__ == "__main__":
    args = parse_args(__doc__)
    print(json.dumps(asyncio.run(main(args.base_url, args.max_tokens))), flush=True)
