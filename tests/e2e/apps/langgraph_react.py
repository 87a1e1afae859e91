"""LangGraph's prebuilt ReAct agent with two real Python tools, run against a kvrelay
gateway: the proof that the graph's model -> tools -> model loop ends with an answer on
the default model (no recursion-limit error). Once with a unary ChatOpenAI and once
with streaming=True, so the streamed tool_call deltas are read by LangChain too. Runs in
the agents venv (frameworks + stdlib only); prints one JSON line.

    .venv-agents/bin/python tests/e2e/apps/langgraph_react.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

import _tools
from _tools import INVOCATIONS, MODEL, parse_args

QUESTION = "What is the weather in London?"
# The brief names langgraph.prebuilt's agent; LangGraph 1.x points to langchain.agents.create_agent.
warnings.filterwarnings("ignore", message="create_react_agent has been moved")
RECURSION_LIMIT = 8  # a loop that never answers fails fast instead of after 25 model calls


get_weather = tool(_tools.get_weather)
multiply = tool(_tools.multiply)


def run_once(base_url: str, max_tokens: int, streaming: bool) -> dict[str, Any]:
    """One ReAct run; what the model asked for, what ran, and how the graph ended."""
    start = len(INVOCATIONS)
    model = ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", temperature=0, max_tokens=max_tokens,
                       streaming=streaming, max_retries=0, timeout=120)
    agent = create_react_agent(model, tools=[get_weather, multiply])
    try:
        state = agent.invoke({"messages": [HumanMessage(QUESTION)]}, {"recursion_limit": RECURSION_LIMIT})
    except GraphRecursionError as exc:  # the model kept calling tools: report the calls, not a traceback
        return {"streaming": streaming, "requested": [], "invocations": INVOCATIONS[start:], "final_answer": "",
                "error": f"GraphRecursionError: {exc}"}
    messages = state["messages"]
    requested = [{"name": c["name"], "arguments": c["args"]} for m in messages if isinstance(m, AIMessage)
                 for c in m.tool_calls]
    tool_errors = [m.content for m in messages if isinstance(m, ToolMessage) and m.status == "error"]
    final = messages[-1]
    return {"streaming": streaming, "requested": requested, "invocations": INVOCATIONS[start:],
            "tool_errors": tool_errors,
            "final_answer": final.content if isinstance(final, AIMessage) and isinstance(final.content, str) else "",
            "final_type": type(final).__name__, "num_messages": len(messages),
            # None for LangGraph's own step-limit message, which no model response made
            "final_finish_reason": final.response_metadata.get("finish_reason") if isinstance(final, AIMessage) else None,
            "message_types": [type(m).__name__ for m in messages]}


def main(base_url: str, max_tokens: int) -> dict[str, Any]:
    runs = [run_once(base_url, max_tokens, streaming) for streaming in (False, True)]
    return {"app": "langgraph_react", "runs": runs, "invocations": INVOCATIONS,
            "final_answer": runs[-1]["final_answer"]}


if __name__ == "__main__":
    args = parse_args(__doc__)
    print(json.dumps(main(args.base_url, args.max_tokens)), flush=True)
