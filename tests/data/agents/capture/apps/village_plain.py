"""Generative-Agents style All-Gather village (4, 6 and 8 villagers; 2-3 rounds): from
round 2 on, every villager reads all of the previous round's answers in its own order,
joined by blank lines (no separator token). Same personas as village_sep. Villagers of
a round are asked concurrently."""

from __future__ import annotations

from _common import Run, parse_args
from _village import TASKS, VillageRun, run_village

APP = "village_plain"
SEPARATOR = "\n\n"
RUNS = [VillageRun(Run("r1", TASKS[0]), 4, 3), VillageRun(Run("r2", TASKS[1], "g1"), 6, 2),
        VillageRun(Run("r3", TASKS[2], "g1"), 8, 2), VillageRun(Run("r4", TASKS[0]), 4, 3)]


def main() -> None:
    recorder, out = parse_args(APP)
    run_village(recorder, RUNS, SEPARATOR)
    print(recorder.save("openai", __doc__.split("\n\n")[0].replace("\n", " "), out))


if __name__ == "__main__":
    main()
