"""Training data: raw prompt/completion rows, chat rows through the template, refusals."""

from __future__ import annotations

import json

import pytest

from engine_ext.adapters.dataset import read_examples
from engine_ext.errors import InvalidRequestError
from engine_ext.tokenizer import Tokenizer


@pytest.fixture
def tokenizer(llama_dir) -> Tokenizer:
    return Tokenizer(llama_dir)


def _write(tmp_path, rows: list) -> object:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_raw_rows_are_tokenized_as_they_are(tmp_path, tokenizer):
    path = _write(tmp_path, [{"prompt": "Question: 2 plus 2?", "completion": " 4."}, "",
                             {"prompt": "3 plus 2?", "completion": " five"}])
    examples = read_examples(path, tokenizer)
    assert examples == [(tokenizer.encode("Question: 2 plus 2?"), tokenizer.encode(" 4.")),
                        (tokenizer.encode("3 plus 2?"), tokenizer.encode(" five"))]
    assert len(read_examples(path, tokenizer, limit=1)) == 1


def test_chat_rows_go_through_the_template_and_end_with_eos(tmp_path, tokenizer):
    chat = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "2 plus 2?"}]
    path = _write(tmp_path, [{"messages": chat + [{"role": "assistant", "content": "4"}]}])
    ((prompt, completion),) = read_examples(path, tokenizer)
    assert prompt == tokenizer.encode(tokenizer.render_chat(chat, add_generation_prompt=True))
    assert completion == tokenizer.encode("4") + [tokenizer.token_id(tokenizer.eos_token)]


@pytest.mark.parametrize("row, message", [
    ("{not json", "data.jsonl:1: not JSON"),
    ({"prompt": "p"}, "data.jsonl:1: needs a non-empty string prompt"),
    ({"prompt": "p", "completion": ""}, "data.jsonl:1: needs a non-empty string prompt"),
    ({"prompt": "", "completion": "c"}, "data.jsonl:1: needs a non-empty string prompt"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "at least two"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]}, "assistant's"),
    ({"messages": "hi"}, "at least two"),
])
def test_bad_rows_are_refused_with_their_line(tmp_path, tokenizer, row, message):
    with pytest.raises(InvalidRequestError, match=message):
        read_examples(_write(tmp_path, [row]), tokenizer)


def test_an_empty_or_missing_file_is_refused(tmp_path, tokenizer):
    with pytest.raises(InvalidRequestError, match="holds no examples"):
        read_examples(_write(tmp_path, [""]), tokenizer)
    with pytest.raises(InvalidRequestError, match="cannot read"):
        read_examples(tmp_path / "missing.jsonl", tokenizer)
