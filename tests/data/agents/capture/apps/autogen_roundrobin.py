"""AutoGen AgentChat RoundRobinGroupChat: three AssistantAgents take turns on a task
until MaxMessageTermination (the task plus two rounds of three answers). The agents
stream their answers (model_client_stream=True), so the recorder's SSE form is what
AutoGen parses. The critic has no system prompt (system_message=None)."""

from __future__ import annotations

import asyncio

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.teams import RoundRobinGroupChat

from _autogen import model_client
from _common import RecorderClient, Run, parse_args

APP = "autogen_roundrobin"
TASKS = [
    "Plan a three-day trip to Lisbon on a small budget.",
    "Write a short product description for a solar-powered bike light.",
    "Suggest a weekly study schedule for learning basic Spanish.",
]
RUNS = [Run("r1", TASKS[0]), Run("r2", TASKS[1], "g1"), Run("r3", TASKS[2], "g1"), Run("r4", TASKS[0])]
ROLES: dict[str, str | None] = {
    "planner": "You are a planner. Break the task into two or three concrete steps. Be brief.",
    "writer": "You are a writer. Turn the plan so far into a short, friendly answer for the user.",
    "critic": None,
}


async def one_run(recorder: RecorderClient, run: Run) -> None:
    agents = [AssistantAgent(name, model_client(recorder.base_url(run.run, name)), system_message=system,
                             model_client_stream=True) for name, system in ROLES.items()]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(7))
    await team.run(task=run.task)


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
