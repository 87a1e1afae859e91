"""Tool calling: how each model family is told about tools and writes its calls
(formats/), the grammar that enforces a call when one is required, and reading calls
back out of the answer, whole or as it streams (calls.py, stream.py)."""
