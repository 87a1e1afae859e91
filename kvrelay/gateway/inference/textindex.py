"""TextIndex: find known texts (earlier outputs, tool results, blocks) inside a prompt.

Each known text is keyed by a polynomial hash of its first `anchor_chars` characters.
A prompt is scanned once: the hash of every window of `anchor_chars` characters is
computed with numpy (prefix sums mod 2^64, normalised by inverse powers of the odd
base), so the scan is linear in the prompt and runs at C speed: a 64k-character prompt
costs about a millisecond whatever the number of known texts. Candidate positions are
then verified character for character, so a hash collision costs time, never a wrong
match.

A text shorter than `anchor_chars` is never looked for inside a prompt (short strings
recur by chance: "214" inside a longer number, "yes" inside any answer); it is found
only as a whole message (`find_whole`), where a tool result such as "214" or a short
answer is quoted in real traffic. A text may be kept under several forms (an answer
as it was produced and with its surrounding whitespace stripped, since apps quote
either); `text_of` gives the first.

The refs that hold one text are grouped by `group(ref)` (a session, in the planner), and
at most `max_holders` groups hold one text: the newest, the older ones' refs leave the
index (their texts stay known under `text_of`). A text every session repeats (an app's
fixed question, a greeting, one task run a thousand times) would otherwise be held by
thousands of sessions, and every prompt that contains it would cost as much to plan as
the app's sessions; those that took it last are also the ones the planner ranks first.
The planner asks of each match what one session holds of it: a lookup by group, an add
and a removal cost the same whatever the number of holders. A match carries a snapshot
of its holders (one small dict of tuples, copied in C), so what the planner learns
while it plans does not change the matches it is reading.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from itertools import chain
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

Ref = TypeVar("Ref", bound=Hashable)
_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd, so invertible mod 2^64
_BASE_INV = np.uint64(pow(int(_BASE), -1, 2**64))
MAX_INSIDE = 64  # places inside matches looked up for a longer overlapping text, per prompt
MAX_HOLDERS = 64  # groups (sessions) that hold one text in the index, the newest


class Holders(Generic[Ref]):
    """The refs that hold one text, by group in the order the groups first took it; an
    immutable snapshot (the index's own is copied on the way out)."""

    __slots__ = ("_by_group",)

    def __init__(self, by_group: dict[Hashable, tuple[Ref, ...]]) -> None:
        self._by_group = by_group

    def of(self, group: Hashable) -> tuple[Ref, ...]:
        """The refs of one group; () when it holds none."""
        return self._by_group.get(group, ())

    @property
    def num_groups(self) -> int:
        return len(self._by_group)

    def __iter__(self) -> Iterator[Ref]:
        return chain.from_iterable(self._by_group.values())

    def __len__(self) -> int:
        return sum(map(len, self._by_group.values()))

    def __eq__(self, other: object) -> bool:
        """Equal to Holders or a tuple of the same refs in the same order."""
        if isinstance(other, Holders | tuple):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Holders{tuple(self)!r}"


class Match(NamedTuple, Generic[Ref]):
    start: int
    end: int
    refs: Holders[Ref]  # every known text equal to prompt[start:end] (outputs can coincide)


_Groups = dict[Hashable, tuple[Any, ...]]  # group -> its refs of one text, in the order they came


def _codes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)


class _Powers:
    """B^i and B^-i mod 2^64, grown on demand."""

    def __init__(self) -> None:
        self.pow: npt.NDArray[np.uint64] = np.ones(1, dtype=np.uint64)
        self.inv: npt.NDArray[np.uint64] = np.ones(1, dtype=np.uint64)

    def ensure(self, n: int) -> None:
        if len(self.pow) >= n:
            return
        size = max(n, 2 * len(self.pow))
        with np.errstate(over="ignore"):
            # B^0 .. B^(size-1)
            self.pow = np.cumprod(np.full(size, _BASE, dtype=np.uint64), dtype=np.uint64) * _BASE_INV
            self.inv = np.cumprod(np.full(size, _BASE_INV, dtype=np.uint64), dtype=np.uint64) * _BASE


_POWERS = _Powers()


_MOD_MASK = 2**64 - 1
_INT_POWERS = [1]  # B^i mod 2^64 as Python ints, grown on demand


def anchor_hash(text: str) -> int:
    """The hash of all of `text` (an anchor), equal to its window's in window_hashes. In
    Python ints, not numpy: for one anchor, the ten numpy calls cost several times the 32
    multiplications (ord() is the code point utf-32 gives)."""
    while len(_INT_POWERS) < len(text):
        _INT_POWERS.append(_INT_POWERS[-1] * int(_BASE) & _MOD_MASK)
    total: int = sum(map(operator.mul, map(ord, text), _INT_POWERS))
    return total & _MOD_MASK


def window_hashes(text: str, k: int) -> np.ndarray:
    """The hash of every window of `k` characters of `text` (len(text) - k + 1 of them, by
    start), equal to the hash of the same characters anywhere else: one linear numpy pass."""
    codes = _codes(text)
    n = len(codes)
    if n < k:
        return np.zeros(0, dtype=np.uint64)
    _POWERS.ensure(n + 1)
    with np.errstate(over="ignore"):
        prefix = np.zeros(n + 1, dtype=np.uint64)
        np.cumsum(codes * _POWERS.pow[:n], out=prefix[1:])
        return (prefix[k:] - prefix[: n - k + 1]) * _POWERS.inv[: n - k + 1]


class TextIndex(Generic[Ref]):
    def __init__(self, anchor_chars: int = 32, group: Callable[[Ref], Hashable] = lambda ref: ref,
                 max_holders: int = MAX_HOLDERS, bounded: Counter[str] | None = None) -> None:
        if anchor_chars < 4:
            raise ValueError("anchor_chars must be at least 4")
        self.anchor_chars = anchor_chars
        self._group = group
        self._max_holders = max_holders
        self._bounded: Counter[str] = bounded if bounded is not None else Counter()  # holders_dropped
        self._by_anchor: dict[int, dict[str, _Groups]] = {}  # anchor hash -> text -> its holders
        self._whole: dict[str, _Groups] = {}  # short text -> its holders: found only as a whole message
        self._forms: dict[Ref, list[str]] = {}  # ref -> its forms, the first as given
        self._table = np.zeros(1, dtype=bool)  # see _filter; rebuilt lazily when _filter_stale
        self._mask = np.uint64(0)
        self._filter_stale = True
        self._num_dead_bits = 0

    def __len__(self) -> int:
        return len(self._forms)

    def add(self, text: str, ref: Ref, forms: tuple[str, ...] = ()) -> bool:
        """Index `text` (and its other `forms`) under `ref`; False when there is nothing
        to index (empty) or `ref` is already indexed."""
        if not text or ref in self._forms:
            return False
        kept = self._forms[ref] = list(dict.fromkeys(f for f in (text, *forms) if f))
        for form in kept:
            if len(form) < self.anchor_chars:
                self._hold(self._whole.setdefault(form, {}), ref)
                continue
            anchor = anchor_hash(form[: self.anchor_chars])
            self._hold(self._by_anchor.setdefault(anchor, {}).setdefault(form, {}), ref)
            if len(self._by_anchor) * 64 > len(self._table) and len(self._table) < 1 << 24:
                self._filter_stale = True  # grow the filter
            elif not self._filter_stale:
                self._table[anchor & int(self._mask)] = True  # a Python int indexes without numpy scalars
        return True

    def text_of(self, ref: Ref) -> str | None:
        forms = self._forms.get(ref)
        return forms[0] if forms else None

    def forms_of(self, ref: Ref) -> tuple[str, ...]:
        """Every form `ref` is indexed under, the first as given; () when unknown."""
        return tuple(self._forms.get(ref, ()))

    def remove(self, ref: Ref) -> None:
        for form in self._forms.pop(ref, ()):
            if len(form) < self.anchor_chars:
                _discard(self._whole, form, self._group(ref), ref)
                continue
            anchor = anchor_hash(form[: self.anchor_chars])
            texts = self._by_anchor.get(anchor)
            if texts is None:
                continue  # its holders were dropped for newer ones, and the others removed
            _discard(texts, form, self._group(ref), ref)
            if not texts:
                del self._by_anchor[anchor]
                self._num_dead_bits += 1  # its filter bit stays set; rebuilt once many are dead
                if self._num_dead_bits > 1024 + len(self._by_anchor):
                    self._filter_stale = True

    def find_whole(self, message: str) -> Match[Ref] | None:
        """A short known text that is the whole message, or the whole message but for
        surrounding whitespace; None otherwise (long texts are found by `find`)."""
        holders = self._whole.get(message)
        if holders:
            return Match(0, len(message), Holders(dict(holders)))
        stripped = message.strip()
        holders = self._whole.get(stripped) if stripped != message else None
        if holders:
            start = len(message) - len(message.lstrip())
            return Match(start, start + len(stripped), Holders(dict(holders)))
        return None

    def find(self, prompt: str) -> list[Match[Ref]]:
        """Known texts inside `prompt`, never overlapping: leftmost first, the longest at
        each position; a longer text that starts inside a match and reaches past it takes
        its place (an answer that repeats the start of the task, inside the task's
        message, gives way to the task). At most MAX_INSIDE places inside matches are
        looked up per prompt, and one compared per match, so a repetitive prompt stays linear."""
        k = self.anchor_chars
        if len(prompt) < k or not self._by_anchor:
            return []
        windows = window_hashes(prompt, k)
        filter_, mask = self._filter()
        candidates = np.flatnonzero(filter_[windows & mask])  # a superset: low hash bits only
        matches: list[Match[Ref]] = []
        covered_until, compared, lookups = 0, True, MAX_INSIDE  # the latest match's end; whether it was looked into
        for start in candidates.tolist():
            if start < covered_until:
                if compared or not lookups:
                    continue  # the common case, kept to one comparison: a repetitive prompt has a candidate everywhere
                lookups -= 1
                latest, anchor = matches[-1], int(windows[start])
                if anchor not in self._by_anchor or anchor == int(windows[latest.start]):
                    continue  # the filter's false alarm, or the same texts again (a repetitive prompt)
                compared = True  # one full comparison inside a match
                found = self._longest_at(prompt, start, anchor)
                if found is not None and found.end > latest.end and found.end - found.start > latest.end - latest.start:
                    matches[-1], covered_until, compared = found, found.end, False
                continue
            found = self._longest_at(prompt, start, int(windows[start]))
            if found is not None:
                matches.append(found)
                covered_until, compared = found.end, False
        return matches

    def _longest_at(self, prompt: str, start: int, anchor: int) -> Match[Ref] | None:
        best: tuple[str, _Groups] | None = None
        for text, holders in self._by_anchor.get(anchor, {}).items():  # {} when the filter erred
            if (best is None or len(text) > len(best[0])) and prompt.startswith(text, start):
                best = (text, holders)
        return Match(start, start + len(best[0]), Holders(dict(best[1]))) if best is not None else None

    def _hold(self, holders: _Groups, ref: Ref) -> None:
        group = self._group(ref)
        if group not in holders and len(holders) >= self._max_holders:
            del holders[next(iter(holders))]  # the group that took the text first
            self._bounded["holders_dropped"] += 1
        holders[group] = (*holders.get(group, ()), ref)  # a new tuple: snapshots taken before keep theirs

    def _filter(self) -> tuple[np.ndarray, np.uint64]:
        """A table indexed by the low bits of a hash, true where some anchor has those bits.
        A gather from it is far cheaper than a search of every window among the anchors;
        sized at about 64 slots per anchor, so few windows pass by accident."""
        if self._filter_stale:
            bits = min(24, max(16, (64 * len(self._by_anchor)).bit_length()))
            self._mask = np.uint64((1 << bits) - 1)
            self._table = np.zeros(1 << bits, dtype=bool)
            self._table[np.array(list(self._by_anchor), dtype=np.uint64) & self._mask] = True
            self._filter_stale, self._num_dead_bits = False, 0
        return self._table, self._mask


def _discard(texts: dict[str, _Groups], text: str, group: Hashable, ref: Any) -> None:
    """Take `ref` out of the holders of `text`, if it is still there (a group may have
    been dropped for newer ones)."""
    holders = texts.get(text)
    if holders is None or group not in holders:
        return
    kept = tuple(r for r in holders[group] if r != ref)
    if kept:
        holders[group] = kept
    else:
        del holders[group]
    if not holders:
        del texts[text]
