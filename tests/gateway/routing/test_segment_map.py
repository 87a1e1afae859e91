"""SegmentMap: where the texts an opted-in request would place were computed."""

from __future__ import annotations

from kvrelay.gateway.routing.segment_map import PlacedText, SegmentMap, placed_texts
from kvrelay.wire.plan import Segment

H1, H2, H3 = "1" * 64, "2" * 64, "3" * 64


def segment(kind: str, start: int, end: int, content_hash: str, method: str | None = "kvcomm",
            source: str | None = None) -> Segment:
    return Segment(message_index=1, char_start=start, char_end=end, kind=kind, content_hash=content_hash,
                   name="p" if kind == "placeholder" else None, source_request=source, method=method)


def test_only_texts_an_approximate_method_places_count():
    plan = [segment("fixed_prefix", 0, 400, H1),  # a prefix hit: the CacheMap's
            segment("placeholder", 400, 800, H2, source="r1"),
            segment("shared_block", 800, 1200, H3),
            segment("private", 1200, 1600, H1)]  # the request's own text
    assert placed_texts(plan) == (PlacedText(H2, "r1", 100), PlacedText(H3, None, 100))
    exact = [s.model_copy(update={"method": None}) for s in plan]
    assert placed_texts(exact) == ()  # an exact plan places nothing from elsewhere
    dense = [s.model_copy(update={"method": "dense"}) for s in plan]
    assert placed_texts(dense) == ()


def test_a_text_is_held_where_its_request_ran_and_where_a_prompt_held_it():
    m = SegmentMap()
    answer = PlacedText(H1, "r1", 120)  # r1's answer, quoted by a later request
    document = PlacedText(H2, None, 300)
    assert m.held_tokens("http://a", (answer, document)) == 0
    m.routed("http://a", "r1", ())  # r1 ran on a: its answer is kept there
    assert m.held_tokens("http://a", (answer, document)) == 120
    assert m.held_tokens("http://b", (answer, document)) == 0
    m.routed("http://b", "r2", (answer, document))  # r2 read both on b, which keeps them too
    assert m.held_tokens("http://b", (answer, document)) == 420
    assert m.held_tokens("http://a", (answer, document)) == 120
    m.routed("http://a", None, (document,))
    assert m.held_tokens("http://a", (answer, document)) == 420


def test_both_tables_are_bounded_least_recent_out():
    m = SegmentMap(max_entries=2)
    for i in range(3):
        m.routed("http://a", f"r{i}", (PlacedText(f"{i}" * 64, None, 10),))
    assert m.held_tokens("http://a", (PlacedText("x" * 64, "r0", 10),)) == 0  # r0 aged out
    assert m.held_tokens("http://a", (PlacedText("x" * 64, "r2", 10),)) == 10
    assert m.held_tokens("http://a", (PlacedText("0" * 64, None, 10), PlacedText("2" * 64, None, 10))) == 10
