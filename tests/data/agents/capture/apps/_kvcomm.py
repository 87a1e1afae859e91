"""The prompt of a KVCOMM / GPTSwarm-style agent, shared by the apps shaped like it
(kvcomm_team, board_openai): the task, then the answers this round's earlier agents
already gave ("At the same time..."), then, from round 2 on, the previous round's
answers of all the others ("In the last round..."). Agents are tagged agent1, agent2,
...; `titles` names each one's role."""

from __future__ import annotations

from collections.abc import Mapping


def outputs_block(intro: str, answers: list[tuple[str, str]], titles: Mapping[str, str]) -> str:
    parts = [intro, ""]
    for agent, answer in answers:
        parts.append(f"Agent {agent.removeprefix('agent')}, role is {titles[agent]}, output is:\n\n{answer}\n")
    return "\n".join(parts)


def prompt(task: str, this_round: list[tuple[str, str]], last_round: list[tuple[str, str]],
           titles: Mapping[str, str]) -> str:
    text = f"The task is: {task}\n"
    if this_round:
        text += "\n" + outputs_block("At the same time, the outputs of other agents are as follows:", this_round,
                                     titles)
    if last_round:
        text += "\n" + outputs_block("In the last round of dialogue, the outputs of other agents were:", last_round,
                                     titles)
    return text
