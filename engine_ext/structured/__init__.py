"""Grammar-constrained decoding: the answer follows a grammar because the sampler never
draws a token the grammar forbids (engine_ext/structured/grammar.py)."""
