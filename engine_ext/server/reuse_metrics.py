"""The engine's reuse counters in Prometheus text, for its /metrics.

What each method actually did on live traffic, cumulative since start: KVCOMM's tokens
placed from anchors and those computed densely to be measured (what learning costs),
TokenDance's rounds prefilled collectively and the bytes their mirrors take against
keeping each cache densely, and the background steps (fidelity probes) that a request's
arrival stopped. The gateway's per-request records say the same per request; these are
what a dashboard plots.
"""

from __future__ import annotations

from engine_ext.served import ReuseCounters

PREFIX = "kvrelay_engine_"


def reuse_metrics(counters: ReuseCounters) -> str:
    lines: list[str] = []

    def counter(name: str, help_: str, samples: list[tuple[str, int]]) -> None:
        lines.extend([f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} counter"])
        lines.extend(f"{PREFIX}{name}{labels} {value}" for labels, value in samples)

    if counters.kvcomm_tokens is not None:
        predicted, measured = counters.kvcomm_tokens
        counter("kvcomm_tokens_total", ("KVCOMM placeholder tokens placed (from anchors, another reader's KV or "
                                         "shifted) or computed to be measured"),
                [('{kind="predicted"}', predicted), ('{kind="measured"}', measured)])
    if counters.collective is not None:
        rounds, members = counters.collective
        counter("collective_rounds_total", "All-Gather round groups prefilled collectively", [("", rounds)])
        counter("collective_members_total", "requests prefilled in collective round groups", [("", members)])
    mirrors = counters.mirrors
    if mirrors is not None:
        counter("round_mirror_bytes_total", "bytes of round caches kept as diffs against their round's master",
                [("", mirrors.mirror_bytes)])
        counter("round_mirrored_dense_bytes_total", "bytes those mirrored caches would take kept densely",
                [("", mirrors.mirrored_dense_bytes)])
        counter("round_mirrored_rows_total", "region rows (tokens) of those mirrored caches",
                [("", mirrors.mirrored_rows)])
        counter("round_mirror_rows_total", "rows their diffs hold verbatim: text no master row holds (unshared), "
                "values unlike the master's (differing), equal ones in a touched block (alongside)",
                [(f'{{cause="{cause}"}}', value) for cause, value in mirrors.mirror_rows._asdict().items()])
    counter("background_steps_interrupted_total", "background steps (fidelity probes) stopped by an arriving request",
            [("", counters.interrupted_steps)])
    return "\n".join(lines) + "\n"
