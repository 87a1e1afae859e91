"""`kvrelay bench agents`: real agent frameworks' captured traffic, replayed through the
gateway with its defaults, side by side with prefix caching alone and vLLM (bench.py);
`--family long`: the long-context captures, with the opt-in methods and their guard
(long.py)."""

from benchmarks.agents.bench import FAMILIES, run

__all__ = ["FAMILIES", "run"]
