"""`kvrelay bench agents`: real agent frameworks' captured traffic, replayed through the
gateway with its defaults, side by side with prefix caching alone and vLLM (bench.py)."""

from benchmarks.agents.bench import run

__all__ = ["run"]
