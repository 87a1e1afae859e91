"""TextIndex: exact spans of known texts in a prompt, leftmost-longest, never overlapping,
with Python-string offsets whatever the characters."""

from __future__ import annotations

import random

import hypothesis
import pytest
from hypothesis import strategies as st

from kvrelay.gateway.inference.textindex import Match, TextIndex, anchor_hash, window_hashes

TEXT_A = "The quarterly report shows revenue up 12 percent."
TEXT_B = "Tool result: 42 rows returned from the orders table."


def index(*texts: tuple[str, str], anchor_chars: int = 32) -> TextIndex[str]:
    idx: TextIndex[str] = TextIndex(anchor_chars)
    for text, ref in texts:
        assert idx.add(text, ref) is True
    return idx


def test_finds_text_at_the_start_of_a_prompt():
    prompt = TEXT_A + " and then more words"
    assert index((TEXT_A, "a")).find(prompt) == [Match(0, 49, ("a",))]


def test_finds_text_in_the_middle_of_a_prompt():
    prompt = "Summary: " + TEXT_A + " Please continue."
    assert index((TEXT_A, "a")).find(prompt) == [Match(9, 58, ("a",))]


def test_finds_text_at_the_end_of_a_prompt():
    prompt = "Earlier you said: " + TEXT_A
    assert index((TEXT_A, "a")).find(prompt) == [Match(18, 67, ("a",))]


def test_finds_a_prompt_that_is_exactly_the_text():
    assert index((TEXT_A, "a")).find(TEXT_A) == [Match(0, len(TEXT_A), ("a",))]


def test_finds_several_texts_leftmost_first():
    prompt = "x " + TEXT_B + " y " + TEXT_A + " z"
    b_start = 2
    a_start = b_start + len(TEXT_B) + 3
    assert index((TEXT_A, "a"), (TEXT_B, "b")).find(prompt) == [
        Match(b_start, b_start + len(TEXT_B), ("b",)),
        Match(a_start, a_start + len(TEXT_A), ("a",)),
    ]


def test_finds_the_same_text_twice_in_one_prompt():
    prompt = TEXT_A + "|" + TEXT_A
    assert index((TEXT_A, "a")).find(prompt) == [Match(0, 49, ("a",)), Match(50, 99, ("a",))]


def test_longer_text_wins_when_both_share_the_anchor_and_both_match():
    short, long = "ABCDEFGHij", "ABCDEFGHijklmnop"
    idx = index((short, "short"), (long, "long"), anchor_chars=8)
    assert idx.find("xx" + long + "yy") == [Match(2, 18, ("long",))]


def test_shorter_text_is_found_when_the_longer_one_does_not_match():
    short, long = "ABCDEFGHij", "ABCDEFGHijklmnop"
    idx = index((short, "short"), (long, "long"), anchor_chars=8)
    assert idx.find("xx" + "ABCDEFGHijQQQQQQ" + "yy") == [Match(2, 12, ("short",))]


def test_overlapping_candidates_keep_the_leftmost_unless_a_longer_one_reaches_past_it():
    first, second = "0123456789abcdef", "89abcdefGHIJ"  # second starts inside first, and is shorter
    idx = index((first, "first"), (second, "second"), anchor_chars=8)
    assert idx.find("..0123456789abcdefGHIJ..") == [Match(2, 18, ("first",))]
    longer = "89abcdefGHIJKLMNOPQR"  # starts inside first, reaches past it and is longer: it wins
    idx = index((first, "first"), (longer, "longer"), anchor_chars=8)
    assert idx.find("..0123456789abcdefGHIJKLMNOPQR..") == [Match(10, 30, ("longer",))]


def test_a_repetitive_prompt_looks_inside_each_match_a_bounded_number_of_times():
    idx = index(("a" * 40, "run"), ("a" * 39 + "b", "other"), anchor_chars=8)
    matches = idx.find("a" * 4000)
    assert [m.end - m.start for m in matches] == [40] * 100


def test_second_text_found_right_after_the_first_ends():
    first, second = "0123456789abcdef", "GHIJKLMNOP"
    idx = index((first, "first"), (second, "second"), anchor_chars=8)
    assert idx.find(first + second) == [Match(0, 16, ("first",)), Match(16, 26, ("second",))]


def test_identical_texts_under_two_refs_are_both_returned():
    idx = index((TEXT_A, "r1"), (TEXT_A, "r2"))
    assert idx.find("> " + TEXT_A) == [Match(2, 51, ("r1", "r2"))]


def test_a_short_text_is_found_only_as_a_whole_message():
    idx: TextIndex[str] = TextIndex(32)
    assert idx.add("214", "s") is True
    assert idx.find("214" * 30) == []  # never inside a prompt: short strings recur by chance
    assert idx.find_whole("214") == Match(0, 3, ("s",))
    assert idx.find_whole(" 214\n") == Match(1, 4, ("s",))
    assert idx.find_whole("2140") is None and idx.find_whole("x 214") is None
    idx.remove("s")
    assert idx.find_whole("214") is None and len(idx) == 0


def test_an_empty_text_is_refused():
    idx: TextIndex[str] = TextIndex(32)
    assert idx.add("", "e") is False and len(idx) == 0


def test_every_form_of_a_text_is_found_and_text_of_is_the_first():
    idx: TextIndex[str] = TextIndex(8)
    padded = TEXT_A + "  \n"
    assert idx.add(padded, "a", forms=(TEXT_A, "short")) is True
    assert idx.text_of("a") == padded
    assert idx.find("say " + padded + "!") == [Match(4, 4 + len(padded), ("a",))]  # the longer form wins
    assert idx.find("say " + TEXT_A + "!") == [Match(4, 4 + len(TEXT_A), ("a",))]
    assert idx.find_whole("short") == Match(0, 5, ("a",))
    idx.remove("a")
    assert idx.find(padded) == [] and idx.find_whole("short") is None


def test_text_exactly_anchor_chars_long_is_indexed():
    idx: TextIndex[str] = TextIndex(8)
    assert idx.add("abcdefgh", "e") is True
    assert idx.find("--abcdefgh--") == [Match(2, 10, ("e",))]


def test_adding_the_same_ref_twice_returns_false_and_keeps_the_first_text():
    idx = index((TEXT_A, "a"))
    assert idx.add(TEXT_B, "a") is False
    assert len(idx) == 1
    assert idx.find(TEXT_B) == []
    assert idx.find(TEXT_A) == [Match(0, 49, ("a",))]


def test_remove_makes_a_text_unfindable_and_keeps_the_others():
    idx = index((TEXT_A, "a"), (TEXT_B, "b"))
    idx.find(TEXT_A)  # build the sorted keys before removing
    idx.remove("a")
    prompt = TEXT_A + " " + TEXT_B
    assert idx.find(prompt) == [Match(50, 50 + len(TEXT_B), ("b",))]
    assert len(idx) == 1


def test_remove_one_of_two_refs_with_identical_text_keeps_the_other():
    idx = index((TEXT_A, "r1"), (TEXT_A, "r2"))
    idx.remove("r1")
    assert idx.find(TEXT_A) == [Match(0, 49, ("r2",))]


def test_remove_shorter_text_sharing_an_anchor_keeps_the_longer():
    short, long = "ABCDEFGHij", "ABCDEFGHijklmnop"
    idx = index((short, "short"), (long, "long"), anchor_chars=8)
    idx.remove("long")
    assert idx.find(long) == [Match(0, 10, ("short",))]
    idx.remove("short")
    assert idx.find(long) == []


def test_remove_unknown_ref_is_a_no_op():
    idx = index((TEXT_A, "a"))
    idx.remove("missing")
    assert idx.find(TEXT_A) == [Match(0, 49, ("a",))]


def test_readding_a_removed_ref_makes_it_findable_again():
    idx = index((TEXT_A, "a"))
    idx.remove("a")
    assert idx.find(TEXT_A) == []
    assert idx.add(TEXT_B, "a") is True
    assert idx.find(TEXT_B) == [Match(0, len(TEXT_B), ("a",))]


def test_non_ascii_text_gives_python_string_offsets():
    text = "Café crème, 東京の天気は晴れ 😀🎉 — naïve résumé ok"
    prompt = "Prefix ☃ " + text + " suffix"
    idx = index((text, "u"), anchor_chars=16)
    [match] = idx.find(prompt)
    assert (match.start, match.end) == (9, 9 + len(text))
    assert prompt[match.start:match.end] == text


def test_near_miss_after_the_anchor_is_not_found():
    idx = index((TEXT_A, "a"))
    altered = TEXT_A[:40] + "X" + TEXT_A[41:]
    assert idx.find("see " + altered + " end") == []


def test_near_miss_inside_the_anchor_is_not_found():
    idx = index((TEXT_A, "a"))
    altered = TEXT_A[:5] + "#" + TEXT_A[6:]
    assert idx.find("see " + altered + " end") == []


def test_truncated_text_is_not_found():
    idx = index((TEXT_A, "a"))
    assert idx.find(TEXT_A[:-1]) == []


def test_anchor_chars_below_four_is_rejected():
    with pytest.raises(ValueError, match="at least 4"):
        TextIndex(3)


def test_anchor_chars_of_four_is_accepted():
    idx = index(("abcd", "x"), anchor_chars=4)
    assert idx.find("zzabcdzz") == [Match(2, 6, ("x",))]


def test_prompt_shorter_than_anchor_returns_empty():
    idx = index(("abcdefgh", "x"), anchor_chars=8)
    assert idx.find("abcdefg") == []
    assert idx.find("") == []


def test_empty_index_finds_nothing():
    assert TextIndex(8).find("abcdefgh" * 4) == []


def test_randomized_planted_texts_are_found_at_exactly_their_spans():
    rnd = random.Random(20240917)
    text_alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZÄÖÜ東京😀🎉"
    filler_alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 .,\n"  # disjoint from text_alphabet
    for _ in range(60):
        anchor = rnd.choice([6, 8, 12, 32])
        idx: TextIndex[str] = TextIndex(anchor)
        texts = {
            f"t{i}": "".join(rnd.choices(text_alphabet, k=rnd.randint(anchor, anchor + 40)))
            for i in range(rnd.randint(1, 6))
        }
        for ref, text in texts.items():
            assert idx.add(text, ref) is True
        for i in range(rnd.randint(0, 3)):  # indexed but never planted
            idx.add("".join(rnd.choices(text_alphabet, k=anchor + 5)), f"decoy{i}")
        prompt, expected = "", []
        for _ in range(rnd.randint(1, 8)):
            prompt += "".join(rnd.choices(filler_alphabet, k=rnd.randint(1, 60)))
            ref = rnd.choice(sorted(texts))
            expected.append(Match(len(prompt), len(prompt) + len(texts[ref]), (ref,)))
            prompt += texts[ref]
        prompt += "".join(rnd.choices(filler_alphabet, k=rnd.randint(0, 60)))
        assert idx.find(prompt) == expected


def test_holders_are_grouped_and_bounded_to_the_newest_groups():
    """A text every session repeats is held by the newest `max_holders` sessions only, so a
    prompt containing it costs the same whatever the number of sessions; a group's refs
    are found by its key, and removing a dropped ref is a no-op."""
    from collections import Counter

    bounded: Counter[str] = Counter()
    idx: TextIndex[tuple[str, int]] = TextIndex(8, group=lambda ref: ref[0], max_holders=4, bounded=bounded)
    for n in range(6):
        assert idx.add("hello", (f"s{n}", 0)) and idx.add(TEXT_A, (f"s{n}", 1))
    assert idx.add(TEXT_A, ("s5", 2))  # a second ref of one group
    whole, [inside] = idx.find_whole("hello"), idx.find("> " + TEXT_A)
    assert whole is not None and whole.refs.num_groups == 4 and inside.refs.num_groups == 4
    assert tuple(whole.refs) == (("s2", 0), ("s3", 0), ("s4", 0), ("s5", 0))
    assert inside.refs.of("s5") == (("s5", 1), ("s5", 2)) and inside.refs.of("s0") == ()
    assert bounded["holders_dropped"] == 4
    assert idx.text_of(("s0", 1)) == TEXT_A  # a dropped holder's text is still known
    for n in range(6):
        idx.remove((f"s{n}", 0))
        idx.remove((f"s{n}", 1))
    idx.remove(("s5", 2))
    assert idx.find_whole("hello") is None and idx.find(TEXT_A) == [] and len(idx) == 0


def test_a_match_keeps_the_holders_it_was_found_with():
    """What the planner adds while it reads a match does not change the match."""
    idx: TextIndex[tuple[str, int]] = TextIndex(8, group=lambda ref: ref[0])
    idx.add(TEXT_A, ("s0", 0))
    [match] = idx.find(TEXT_A)
    idx.add(TEXT_A, ("s0", 1))
    idx.add(TEXT_A, ("s1", 0))
    idx.remove(("s0", 0))
    assert tuple(match.refs) == (("s0", 0),) and match.refs.of("s1") == ()
    assert tuple(idx.find(TEXT_A)[0].refs) == (("s0", 1), ("s1", 0))


@hypothesis.given(text=st.text(min_size=1, max_size=300) | st.sampled_from(["\ud800abc", "\U0001F600" * 40, "a" * 4096]))
@hypothesis.settings(max_examples=300, deadline=None, database=None)
def test_anchor_hash_is_the_window_hash_of_the_whole_text(text):
    """The index files a text under anchor_hash and finds it with window_hashes: the two must agree."""
    assert anchor_hash(text) == int(window_hashes(text, len(text))[0])
