from __future__ import annotations

import pytest

from engine_ext.detokenizer import Detokenizer
from engine_ext.tokenizer import Tokenizer


class Pieces:
    """A decoder over a fixed piece table: token i decodes to PIECES[i]."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


def stream(pieces: list[str], stop: tuple[str, ...] = (), final_at_end: bool = True):
    """Feed tokens one by one as the engine does; return (deltas, stopped_at_index, detok)."""
    dec = Pieces(pieces)
    detok = Detokenizer(dec, stop)
    deltas, stopped_at = [], None
    for n in range(1, len(pieces) + 1):
        res = detok.update(list(range(n)), final=final_at_end and n == len(pieces))
        deltas.append(res.delta)
        if res.stopped:
            stopped_at = n - 1
            break
    return deltas, stopped_at, detok


def assert_never_withdrawn(deltas: list[str], stop: tuple[str, ...]) -> None:
    released = ""
    for d in deltas:
        released += d
        for s in stop:
            assert s not in released


def test_no_stop_releases_everything():
    deltas, stopped, detok = stream(["Hel", "lo", " wor", "ld"])
    assert deltas == ["Hel", "lo", " wor", "ld"]
    assert stopped is None
    assert detok.text == "Hello world"


def test_stop_split_across_tokens_is_never_released():
    pieces = ["The ", "answer", " S", "T", "OP", " ignored"]
    deltas, stopped, detok = stream(pieces, stop=("STOP",))
    assert stopped == 4
    assert "".join(deltas) == "The answer "
    assert detok.text == "The answer "
    # " S" and "T" were held back (they might begin the stop string), not released then withdrawn
    assert deltas[2] == " " and deltas[3] == ""
    assert_never_withdrawn(deltas, ("STOP", "S", "ST"))


def test_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    deltas, stopped, detok = stream(["x", "S", "T", "ART", "!"], stop=("STOP",))
    assert stopped is None
    assert deltas == ["x", "", "", "START", "!"]
    assert detok.text == "xSTART!"


def test_final_flush_releases_held_back_text():
    deltas, stopped, detok = stream(["ok ", "ST"], stop=("STOP",))
    assert stopped is None
    assert deltas == ["ok ", "ST"]  # final: nothing can follow, so the prefix is text
    assert detok.text == "ok ST"
    deltas, _, detok = stream(["ok ", "ST"], stop=("STOP",), final_at_end=False)
    assert deltas == ["ok ", ""]


def test_stop_inside_one_token_returns_text_before_it():
    deltas, stopped, detok = stream(["abc", "de</s>fg", "h"], stop=("</s>",))
    assert stopped == 1
    assert "".join(deltas) == "abcde"


def test_earliest_of_several_stop_strings_wins():
    deltas, stopped, detok = stream(["one two", " three four"], stop=("four", "two"))
    assert stopped == 0
    assert detok.text == "one "
    deltas, stopped, detok = stream(["aaa", "bbb c", "ccc"], stop=("ccc", "bb c"))
    assert detok.text == "aaab"
    assert stopped == 1


def test_stop_string_at_the_very_start():
    deltas, stopped, detok = stream(["##", "x"], stop=("##",))
    assert stopped == 0
    assert deltas == [""]
    assert detok.text == ""


def test_overlapping_stop_prefixes():
    # "ab" could begin "abc"; "b" alone could begin "bd"
    pieces = ["a", "b", "d", "zz"]
    deltas, stopped, detok = stream(pieces, stop=("abc", "bd"))
    assert stopped == 2
    assert detok.text == "a"
    assert_never_withdrawn(deltas, ("abc", "bd"))


def test_incomplete_utf8_is_held_back():
    pieces = ["caf", "\ufffd", "", "!"]

    class Utf8:
        def decode(self, ids, skip_special_tokens=True):
            # tokens 1 and 2 are the two bytes of "é": incomplete until both arrive
            text = "caf"
            if len(ids) == 2:
                text += "\ufffd"
            elif len(ids) >= 3:
                text += "é"
            if len(ids) >= 4:
                text += "!"
            return text

    detok = Detokenizer(Utf8())
    out = [detok.update(list(range(n))).delta for n in range(1, 5)]
    assert out == ["caf", "", "é", "!"]
    assert len(pieces) == 4


def test_real_tokenizer_stream_equals_decode(llama_dir):
    tok = Tokenizer(llama_dir)
    text = "Paris is the capital of France. Agents share the cache of keys and values!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = Detokenizer(tok, stop=("keys",))
    deltas = []
    for n in range(1, len(ids) + 1):
        res = detok.update(ids[:n])
        deltas.append(res.delta)
        if res.stopped:
            break
    assert "".join(deltas) == "Paris is the capital of France. Agents share the cache of "
    assert res.stopped


@pytest.mark.parametrize("stop", [("the",), ("e c",), ("France. A", "xyz")])
def test_real_tokenizer_never_releases_stop_text(llama_dir, stop):
    tok = Tokenizer(llama_dir)
    text = "Paris is the capital of France. Agents share the cache."
    ids = tok.encode(text)
    detok = Detokenizer(tok, stop=stop)
    released = ""
    for n in range(1, len(ids) + 1):
        res = detok.update(ids[:n], final=n == len(ids))
        released += res.delta
        for s in stop:
            assert s not in released
        if res.stopped:
            break
    cut = min(i for i in (text.find(s) for s in stop) if i >= 0)
    assert released == text[:cut]


def test_real_tokenizer_streams_multibyte_text_without_replacement_chars(llama_dir):
    tok = Tokenizer(llama_dir)
    text = "Café — naïve 東京 🙂 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # non-ASCII falls apart into byte tokens
    detok = Detokenizer(tok, stop=("🙂 d",))
    released = ""
    for n in range(1, len(ids) + 1):
        res = detok.update(ids[:n], final=n == len(ids))
        assert "\ufffd" not in res.delta
        released += res.delta
        if res.stopped:
            break
    assert res.stopped
    assert released == "Café — naïve 東京 "
