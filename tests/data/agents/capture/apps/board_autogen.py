"""AutoGen AgentChat review board over a long passage: a RoundRobinGroupChat of five
AssistantAgents (chair, engineer, archivist, skeptic, editor), each with a ~600-character
persona as its system message, one turn each (MaxMessageTermination(6): the task plus
five answers). The task is one user message: a ~3,500-character passage and a question
about it. Six runs, one passage each, one after another; answers up to 128 tokens,
streamed (model_client_stream=True)."""

from __future__ import annotations

import asyncio

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.teams import RoundRobinGroupChat

from _autogen import model_client
from _board import MEMBERS, RUNS
from _common import LONG_MAX_TOKENS, RecorderClient, Run, parse_args

APP = "board_autogen"


async def one_run(recorder: RecorderClient, run: Run) -> None:
    agents = [AssistantAgent(m.name, model_client(recorder.base_url(run.run, m.name), LONG_MAX_TOKENS),
                             system_message=m.persona, model_client_stream=True) for m in MEMBERS]
    team = RoundRobinGroupChat(agents, termination_condition=MaxMessageTermination(len(MEMBERS) + 1))
    await team.run(task=run.task)


async def main() -> None:
    recorder, out = parse_args(APP)
    for run in RUNS:
        recorder.register_run(run)
    for run in RUNS:
        await one_run(recorder, run)
    print(recorder.save("autogen-agentchat", __doc__.split("\n\n")[0].replace("\n", " "), out))


if __name__ == "__main__":
    asyncio.run(main())
