"""RoundHold: early requests of a round wait for the last one, never longer than the hold."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from kvrelay.wire.plan import RoundInfo
from kvrelay.gateway.inference import RoundHold
from kvrelay.gateway.settings import InferenceSettings


def test_the_last_request_of_a_round_releases_the_early_ones_at_once():
    async def run() -> list[float]:
        hold = RoundHold(hold_ms=5_000)  # long: only the release can end the wait in time
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def member(index: int, delay: float) -> float:
            await asyncio.sleep(delay)
            await hold.wait(RoundInfo(id="s/r1", size=3, index=index))
            return loop.time() - start

        done = await asyncio.gather(member(0, 0), member(1, 0.01), member(2, 0.03))
        assert hold.num_released_together == 2
        return done

    times = asyncio.run(run())
    assert all(0.025 < t < 1.0 for t in times)  # nobody left before the last arrived, nobody waited the hold


def test_a_round_that_never_completes_costs_at_most_the_hold():
    async def run() -> float:
        hold = RoundHold(hold_ms=20)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await hold.wait(RoundInfo(id="s/r1", size=4, index=0))
        assert hold.num_released_together == 0 and not hold._waiting
        return loop.time() - start

    assert 0.015 < asyncio.run(run()) < 0.5


def test_the_hold_is_bounded_to_a_few_milliseconds():
    assert InferenceSettings(round_hold_ms=5).round_hold_ms == 5
    with pytest.raises(ValidationError):
        InferenceSettings(round_hold_ms=500)
