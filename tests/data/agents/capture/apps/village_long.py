"""Long-context All-Gather village, plain `openai` client code, TokenDance-shaped like
village_sep: ten villagers with ~900-character persona-and-memory system prompts, two
rounds. Every prompt starts with the day's ~2,300 characters of town notes (the task);
in round 2 each villager also reads all nine others' round-1 answers, in an order of
its own, joined by blank lines. A round's ten requests are sent concurrently. Six runs,
one day each, one after another; answers up to 128 tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from _common import LONG_MAX_TOKENS, RecorderClient, Run, parse_args
from _town import DAYS, PERSONAS
from _village import ask, heard_order

APP = "village_long"
RUNS = [Run(f"r{i}", day.task()) for i, day in enumerate(DAYS, start=1)]
NAMES = list(PERSONAS)


def prompt(task: str, round_: int, heard: str) -> str:
    if round_ == 1:
        return f"{task}\n\nIt is 8:00 am. What is your plan for today? Answer in two or three sentences."
    return (f"{task}\n\nIt is 5:00 pm. This is what the others said this morning:\n\n{heard}\n\n"
            "What do you do next, and with whom? Answer in two or three sentences.")


def heard(run: str, agent: str, round_: int, previous: dict[str, str]) -> str:
    """All the others' answers of the last round (none in round 1), in this villager's order."""
    order = heard_order(run, agent, round_, NAMES)
    return "\n\n".join(f"{a}: {previous[a]}" for a in order if a != agent and a in previous)


def one_run(recorder: RecorderClient, run: Run) -> None:
    previous: dict[str, str] = {}
    with ThreadPoolExecutor(len(NAMES)) as pool:
        for round_ in (1, 2):
            prompts = {agent: prompt(run.task, round_, heard(run.run, agent, round_, previous)) for agent in NAMES}
            futures = {agent: pool.submit(ask, recorder, run.run, agent, round_, prompts[agent], PERSONAS[agent],
                                          LONG_MAX_TOKENS) for agent in NAMES}
            previous = {agent: future.result() for agent, future in futures.items()}


def main() -> None:
    recorder, out = parse_args(APP)
    for run in RUNS:
        recorder.register_run(run)
    for run in RUNS:
        one_run(recorder, run)
    print(recorder.save("openai", __doc__.split("\n\n")[0].replace("\n", " "), out))


if __name__ == "__main__":
    main()
