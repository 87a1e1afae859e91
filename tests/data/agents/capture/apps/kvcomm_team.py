"""KVCOMM / GPTSwarm fully connected team, plain `openai` client code: five agents with
distinct role prompts answer a question in two rounds. Each agent's prompt holds the
question, the answers this round's earlier agents already gave ("At the same time...")
and, from round 2 on, the previous round's answers of all the others ("In the last
round..."), so agent 5 of round 2 reads the most. The round is in the tag."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

from _common import API_KEY, MAX_TOKENS, MODEL, TEMPERATURE, RecorderClient, Run, parse_args
from _kvcomm import prompt

APP = "kvcomm_team"
ROUNDS = 2
ROLES = {
    "agent1": ("Math Solver", "You are a math solver. Work the numbers out step by step, briefly."),
    "agent2": ("Fact Checker", "You are a fact checker. Check the claims made so far and correct mistakes."),
    "agent3": ("Programmer", "You are a programmer. Explain how you would compute the answer in code."),
    "agent4": ("Critic", "You are a critic. Name the weakest point of the answers so far."),
    "agent5": ("Summariser", "You are a summariser. Give the final answer in one sentence."),
}
TASKS = [
    "A shop sells pens at 3 for 2 dollars. How much do 12 pens cost?",
    "Is 91 a prime number? Explain why or why not.",
    "A train leaves at 14:20 and the trip takes 95 minutes. When does it arrive?",
]
RUNS = [Run("r1", TASKS[0]), Run("r2", TASKS[1], "g1"), Run("r3", TASKS[2], "g1"), Run("r4", TASKS[0])]
TITLES = {agent: title for agent, (title, _) in ROLES.items()}


def one_run(recorder: RecorderClient, run: Run) -> None:
    previous: dict[str, str] = {}
    for round_ in range(1, ROUNDS + 1):
        current: dict[str, str] = {}
        for agent, (_, system) in ROLES.items():
            client = OpenAI(base_url=recorder.base_url(run.run, agent, round_), api_key=API_KEY)
            last_round = [(a, text) for a, text in previous.items() if a != agent]
            reply = client.chat.completions.create(
                model=MODEL, temperature=TEMPERATURE, max_tokens=MAX_TOKENS,
                messages=[{"role": "system", "content": system},
                          {"role": "user", "content": prompt(run.task, list(current.items()), last_round, TITLES)}])
            current[agent] = reply.choices[0].message.content or ""
        previous = current


def main() -> None:
    recorder, out = parse_args(APP)
    for run in RUNS:
        recorder.register_run(run)
    one_run(recorder, RUNS[0])
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(one_run, recorder, run) for run in RUNS[1:3]]:
            future.result()
    one_run(recorder, RUNS[3])
    print(recorder.save("openai", __doc__.split("\n\n")[0].replace("\n", " "), out))


if __name__ == "__main__":
    main()
