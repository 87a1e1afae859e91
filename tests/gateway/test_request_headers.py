"""RequestHeaders reads a request's headers as Starlette's Headers.get does."""

from __future__ import annotations

from starlette.datastructures import Headers

from kvrelay.gateway.request_headers import RequestHeaders

RAW = [(b"content-type", b"application/json"), (b"x-kvrelay-session-id", b"first"),
       (b"X-Kvrelay-Session-Id", b"second"), (b"authorization", b"Bearer sk-\xe9")]


def test_lookups_match_starlettes_headers():
    ours, theirs = RequestHeaders(RAW), Headers(raw=RAW)
    for name in ("content-type", "Content-Type", "x-kvrelay-session-id", "X-KVRELAY-SESSION-ID", "authorization",
                 "traceparent"):
        assert ours.get(name) == theirs.get(name)
        assert (name in ours) == (name in theirs)
    assert ours["X-Kvrelay-Session-Id"] == "first"  # the first of a repeated header, as Starlette's get
    assert ours.get("missing", "default") == "default" and ours.get("missing") is None
    assert sorted(ours) == ["authorization", "content-type", "x-kvrelay-session-id"] and len(ours) == 3
    assert 3 not in ours
