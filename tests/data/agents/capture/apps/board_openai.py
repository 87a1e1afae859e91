"""KVCOMM-shaped review board over a long passage, plain `openai` client code: five agents
(agent1..agent5: chair, engineer, archivist, skeptic, editor) with ~600-character
personas as system prompts, one round. Each agent's one user message is "The task is:"
with the passage and its question, then the outputs of the agents before it ("At the
same time..."), so agent 5 reads the passage and four answers. Six runs, one passage
each, one after another; answers up to 128 tokens."""

from __future__ import annotations

from openai import OpenAI

from _board import MEMBERS, RUNS
from _common import API_KEY, LONG_MAX_TOKENS, MODEL, TEMPERATURE, RecorderClient, Run, parse_args
from _kvcomm import prompt

APP = "board_openai"
AGENTS = {f"agent{i}": member for i, member in enumerate(MEMBERS, start=1)}
TITLES = {agent: member.title for agent, member in AGENTS.items()}
ROUND = 1


def one_run(recorder: RecorderClient, run: Run) -> None:
    answers: list[tuple[str, str]] = []
    for agent, member in AGENTS.items():
        client = OpenAI(base_url=recorder.base_url(run.run, agent, ROUND), api_key=API_KEY)
        reply = client.chat.completions.create(
            model=MODEL, temperature=TEMPERATURE, max_tokens=LONG_MAX_TOKENS,
            messages=[{"role": "system", "content": member.persona},
                      {"role": "user", "content": prompt(run.task, answers, [], TITLES)}])
        answers.append((agent, reply.choices[0].message.content or ""))


def main() -> None:
    recorder, out = parse_args(APP)
    for run in RUNS:
        recorder.register_run(run)
    for run in RUNS:
        one_run(recorder, run)
    print(recorder.save("openai", __doc__.split("\n\n")[0].replace("\n", " "), out))


if __name__ == "__main__":
    main()
