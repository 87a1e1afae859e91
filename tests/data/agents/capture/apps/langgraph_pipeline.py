"""LangGraph StateGraph pipeline research -> draft -> edit -> title over MessagesState:
each node is one ChatOpenAI call on its role prompt plus the conversation so far, and
appends its answer as an AIMessage named after the node, as LangGraph's multi-agent
examples do. The title node sends no system prompt: one user message quoting the
edited text."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.graph import END, START, MessagesState, StateGraph

from _common import RecorderClient, Run, parse_args
from _langchain import chat_model

APP = "langgraph_pipeline"
TASKS = [
    "Write a short note for new employees about how to book a meeting room.",
    "Explain to customers why our café is switching to reusable cups.",
    "Describe the benefits of a ten-minute daily walk.",
]
RUNS = [Run("r1", TASKS[0]), Run("r2", TASKS[1]), Run("r3", TASKS[2], "g1"), Run("r4", TASKS[0], "g1")]
ROLES = {
    "research": "You are a researcher. List two or three key points the text must cover.",
    "draft": "You are a writer. Write a short first draft from the key points.",
    "edit": "You are an editor. Rewrite the draft so it is clear and friendly. Keep it short.",
}
Node = Callable[[MessagesState], Awaitable[dict[str, Any]]]


def role_node(recorder: RecorderClient, run: str, name: str) -> Node:
    llm = chat_model(recorder.base_url(run, name))

    async def node(state: MessagesState) -> dict[str, Any]:
        reply = await llm.ainvoke([SystemMessage(ROLES[name]), *state["messages"]])
        return {"messages": [AIMessage(reply.content, name=name)]}
    return node


def title_node(recorder: RecorderClient, run: str) -> Node:
    llm = chat_model(recorder.base_url(run, "title"))

    async def node(state: MessagesState) -> dict[str, Any]:
        text = state["messages"][-1].content
        reply = await llm.ainvoke([HumanMessage(f"Give this text a short title:\n\n{text}")])
        return {"messages": [AIMessage(reply.content, name="title")]}
    return node


def build(recorder: RecorderClient, run: str) -> Any:
    graph = StateGraph(MessagesState)
    for name in ROLES:
        graph.add_node(name, role_node(recorder, run, name))
    graph.add_node("title", title_node(recorder, run))
    graph.add_edge(START, "research")
    graph.add_edge("research", "draft")
    graph.add_edge("draft", "edit")
    graph.add_edge("edit", "title")
    graph.add_edge("title", END)
    return graph.compile()


async def one_run(recorder: RecorderClient, run: Run) -> None:
    await build(recorder, run.run).ainvoke({"messages": [HumanMessage(run.task)]})


async def main() -> None:
    recorder, out = parse_args(APP)
    for run in RUNS:
        recorder.register_run(run)
    await one_run(recorder, RUNS[0])
    await one_run(recorder, RUNS[1])
    await asyncio.gather(one_run(recorder, RUNS[2]), one_run(recorder, RUNS[3]))
    print(recorder.save("langgraph", __doc__.split("\n\n")[0].replace("\n", " "), out))


if __name__ == "__main__":
    asyncio.run(main())
