"""SupervisedTask: a loop that ends by surprise is restarted; one asked to stop is not."""

from __future__ import annotations

import asyncio

from kvrelay.gateway.supervisor import SupervisedTask


async def test_a_loop_that_fails_is_restarted_until_stopped():
    runs: list[int] = []

    async def loop() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise KeyError("a bug nobody expected")
        if len(runs) == 2:
            return  # returning without being asked to stop is a failure too
        await asyncio.Event().wait()

    task = SupervisedTask("test-loop", loop, restart_delay_s=0.01)
    task.start()
    for _ in range(200):
        if len(runs) == 3 and task.alive:
            break
        await asyncio.sleep(0.01)
    assert (len(runs), task.num_restarts, task.alive) == (3, 2, True)
    await task.stop()
    await asyncio.sleep(0.05)
    assert not task.alive and len(runs) == 3 and task.num_restarts == 2


async def test_join_waits_for_a_loop_that_stops_its_own_way():
    stop = asyncio.Event()

    async def loop() -> None:
        await stop.wait()

    task = SupervisedTask("test-loop", loop, restart_delay_s=0.01)
    task.start()
    stop.set()
    await task.join()
    await asyncio.sleep(0.05)
    assert not task.alive and task.num_restarts == 0
