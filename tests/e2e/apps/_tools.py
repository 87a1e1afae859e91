"""The tools every framework app here gives its agent, and the apps' command line.

The tools record each call they really run (INVOCATIONS), so an app reports what ran,
not what the model asked for. Plain functions: each framework wraps them its own way.
Runs in the agents venv: stdlib only."""

from __future__ import annotations

import argparse
from typing import Any

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"Paris": "sunny, 21 degrees C", "London": "light rain, 14 degrees C", "Tokyo": "cloudy, 18 degrees C"}
INVOCATIONS: list[dict[str, Any]] = []  # appended by the tools themselves: what really ran


def get_weather(city: str) -> str:
    """The current weather in a city."""
    result = WEATHER.get(city, f"No weather data for {city}.")
    INVOCATIONS.append({"name": "get_weather", "arguments": {"city": city}, "result": result})
    return result


def multiply(a: float, b: float) -> str:
    """Multiply two numbers."""
    result = str(a * b)
    INVOCATIONS.append({"name": "multiply", "arguments": {"a": a, "b": b}, "result": result})
    return result


def parse_args(doc: str | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the gateway's /v1 URL")
    parser.add_argument("--max-tokens", type=int, default=64)
    return parser.parse_args()
