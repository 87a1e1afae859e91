"""AutoGen AgentChat SelectorGroupChat: before every turn the group chat manager asks the
model (tag agent `selector`) which of three AssistantAgents speaks next, from the
agents' descriptions and the transcript; a reply naming no valid agent, several, or the
previous speaker is retried with AutoGen's feedback message (up to 3 attempts), then
AutoGen falls back on its own. Ends by MaxMessageTermination (the task plus four turns)."""

from __future__ import annotations

import asyncio

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.teams import SelectorGroupChat

from _autogen import model_client
from _common import RecorderClient, Run, parse_args

APP = "autogen_selector"
TASKS = [
    "Find a name and a slogan for a neighbourhood bakery.",
    "Explain why the sky is blue to a ten-year-old.",
    "Prepare three interview questions for a junior data analyst.",
]
RUNS = [Run("r1", TASKS[0]), Run("r2", TASKS[1]), Run("r3", TASKS[2], "g1"), Run("r4", TASKS[0], "g1")]
# name -> (description the selector reads, system prompt)
AGENTS = {
    "researcher": ("Finds the facts the task needs.",
                   "You are a researcher. Give one or two useful facts for the task. Be brief."),
    "writer": ("Writes the answer for the user.",
               "You are a writer. Write a short answer for the user from what was said."),
    "reviewer": ("Checks the answer and suggests one improvement.",
                 "You are a reviewer. Point out one thing to improve, in one sentence."),
}


async def one_run(recorder: RecorderClient, run: Run) -> None:
    agents = [AssistantAgent(name, model_client(recorder.base_url(run.run, name)), description=description,
                             system_message=system) for name, (description, system) in AGENTS.items()]
    team = SelectorGroupChat(agents, model_client=model_client(recorder.base_url(run.run, "selector")),
                             termination_condition=MaxMessageTermination(5))
    await team.run(task=run.task)


async def main() -> None:
    recorder, out = parse_args(APP)
    for run in RUNS:
        recorder.register_run(run)
    await one_run(recorder, RUNS[0])
    await one_run(recorder, RUNS[1])
    await asyncio.gather(one_run(recorder, RUNS[2]), one_run(recorder, RUNS[3]))
    print(recorder.save("autogen-agentchat", __doc__.split("\n\n")[0].replace("\n", " "), out))


if __name__ == "__main__":
    asyncio.run(main())
