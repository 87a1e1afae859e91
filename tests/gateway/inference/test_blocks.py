"""split_blocks: spans between <TTSEP>, <kv_start>/<kv_end> and custom separators, stripped
of whitespace, as offsets into the original text."""

from __future__ import annotations

from kvrelay.gateway.inference.blocks import KV_END, KV_START, TTSEP, Block, split_blocks


def texts(text: str, blocks: list[Block]) -> list[str]:
    return [text[b.start:b.end] for b in blocks]


def test_marker_constants():
    assert (TTSEP, KV_START, KV_END) == ("<TTSEP>", "<kv_start>", "<kv_end>")


def test_text_without_markers_is_not_split():
    assert split_blocks("Just a plain message with no markers.") == []


def test_empty_text_is_not_split():
    assert split_blocks("") == []


def test_ttsep_blocks_have_exact_offsets():
    text = "first block<TTSEP>second block<TTSEP>third"
    assert split_blocks(text) == [Block(0, 11), Block(18, 30), Block(37, 42)]
    assert texts(text, split_blocks(text)) == ["first block", "second block", "third"]


def test_blocks_are_stripped_of_surrounding_whitespace():
    text = "  alpha \n<TTSEP>\n\tbeta  gamma \n"
    assert split_blocks(text) == [Block(2, 7), Block(18, 29)]
    assert texts(text, split_blocks(text)) == ["alpha", "beta  gamma"]


def test_kv_start_end_encloses_a_document():
    text = "<kv_start>doc<kv_end>"
    assert split_blocks(text) == [Block(10, 13)]


def test_kv_markers_with_surrounding_text_give_three_blocks():
    text = "Question: why? <kv_start> Retrieved doc body. <kv_end> Answer briefly."
    blocks = split_blocks(text)
    assert blocks == [Block(0, 14), Block(26, 45), Block(55, 70)]
    assert texts(text, blocks) == ["Question: why?", "Retrieved doc body.", "Answer briefly."]


def test_mixed_ttsep_and_kv_markers():
    text = "A <TTSEP> B <kv_start> C <kv_end> D"
    assert texts(text, split_blocks(text)) == ["A", "B", "C", "D"]
    assert split_blocks(text) == [Block(0, 1), Block(10, 11), Block(23, 24), Block(34, 35)]


def test_empty_blocks_between_adjacent_markers_are_skipped():
    text = "<TTSEP>one<TTSEP><TTSEP>  <TTSEP>two<TTSEP>"
    assert split_blocks(text) == [Block(7, 10), Block(33, 36)]
    assert texts(text, split_blocks(text)) == ["one", "two"]


def test_only_markers_gives_no_blocks():
    assert split_blocks("<TTSEP><kv_start><kv_end>") == []


def test_custom_separators_replace_ttsep():
    text = "intro\n---\nbody<TTSEP>still body\n---\noutro"
    blocks = split_blocks(text, separators=("\n---\n",))
    assert blocks == [Block(0, 5), Block(10, 31), Block(36, 41)]
    assert texts(text, blocks) == ["intro", "body<TTSEP>still body", "outro"]


def test_several_custom_separators_and_kv_markers_still_apply():
    text = "a###b@@@c<kv_start>d<kv_end>"
    assert texts(text, split_blocks(text, separators=("###", "@@@"))) == ["a", "b", "c", "d"]


def test_offsets_index_the_original_non_ascii_string():
    text = "Café ☕<TTSEP>東京 😀 block<TTSEP> naïve"
    blocks = split_blocks(text)
    assert blocks == [Block(0, 6), Block(13, 23), Block(31, 36)]
    assert texts(text, blocks) == ["Café ☕", "東京 😀 block", "naïve"]
