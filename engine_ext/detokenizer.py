"""Incremental detokenization with stop strings.

Text is released only when it can no longer turn into a stop string or an incomplete
UTF-8 character, so a streamed response never shows text that is later withdrawn.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol


class _Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class DetokenizerResult(NamedTuple):
    delta: str
    stopped: bool  # a stop string was found; the text ends just before it


class Detokenizer:
    def __init__(self, decoder: _Decoder, stop: tuple[str, ...] = ()) -> None:
        self._decoder = decoder
        self._stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self.text = ""  # released so far

    def update(self, output_ids: list[int], final: bool = False) -> DetokenizerResult:
        """Decode all output ids; return the newly releasable text."""
        full = self._decoder.decode(output_ids)
        if self._stop:
            search_from = max(0, len(self.text) - self._max_stop + 1)
            hits = [i for i in (full.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                return self._release(full[: min(hits)], stopped=True)
        if final:
            return self._release(full, stopped=False)
        end = len(full.rstrip("\ufffd"))  # an incomplete multi-byte character decodes to U+FFFD
        end -= self._stop_prefix_len(full[:end])
        return self._release(full[:end], stopped=False)

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that begins some stop string."""
        for k in range(min(len(text), self._max_stop - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0

    def _release(self, upto: str, stopped: bool) -> DetokenizerResult:
        if not upto.startswith(self.text) or len(upto) <= len(self.text):
            return DetokenizerResult("", stopped)
        delta = upto[len(self.text) :]
        self.text = upto
        return DetokenizerResult(delta, stopped)
