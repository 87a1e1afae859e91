"""The engines' block reports, read tolerantly by the gateway."""

from __future__ import annotations

from kvrelay.wire.cache_report import BLOCKS_KEY, MAX_PROMPT_BLOCKS, CacheReport, digest, read_prompt_blocks

GOOD = "0123456789abcdef"


def test_a_digest_is_the_hashs_first_eight_bytes_in_hex():
    assert digest(bytes(range(16))) == "0001020304050607"


def test_a_report_keeps_well_formed_digests_and_drops_the_rest():
    report = CacheReport.read({"block_size": 16, "device": [GOOD, "XYZ", GOOD.upper()], "lower": [GOOD[::-1]]})
    assert report is not None and report.device == [GOOD] and report.lower == [GOOD[::-1]]
    for bad in (None, [], {"device": [GOOD]}, {"block_size": 0, "device": []}, {"block_size": 16, "device": "x"},
                {"block_size": "16x", "device": []}):
        assert CacheReport.read(bad) is None


def test_prompt_blocks_are_taken_whole_or_not_at_all():
    assert read_prompt_blocks({BLOCKS_KEY: [GOOD, GOOD]}) == [GOOD, GOOD]
    assert read_prompt_blocks({BLOCKS_KEY: [GOOD, 7]}) is None  # a gap would shift every later block
    assert read_prompt_blocks({BLOCKS_KEY: [GOOD] * (MAX_PROMPT_BLOCKS + 1)}) is None
    assert read_prompt_blocks({BLOCKS_KEY: GOOD}) is None
    assert read_prompt_blocks({}) is None and read_prompt_blocks(None) is None
