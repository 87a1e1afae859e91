"""Our chat-template rendering must equal transformers' apply_chat_template byte for byte."""

from __future__ import annotations

import functools
import json
import shutil

import pytest

from engine_ext.errors import InvalidRequestError, ModelLoadError
from engine_ext.tokenizer import ChatTemplate, Tokenizer

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Another one, with\nnewlines\n\nand  spaces "},
    ],
    "unicode": [{"role": "user", "content": "Café — naïve 東京 🙂"}],
    "empty_content": [{"role": "user", "content": ""}],
}

# A template exercising what HF templates use: trimming, raise_exception, tojson, loop vars,
# `{%- -%}`, namespace and a default system prompt.
TRICKY_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system = 'default system' %}
    {%- set loop_messages = messages %}
{%- endif %}
{{ bos_token }}[SYS] {{ system }}
{% if tools %}TOOLS: {{ tools | tojson }}
{% endif %}
{% set ns = namespace(n=0) %}
{% for message in loop_messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('bad role ' + message['role']) }}
    {% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if loop.index0 > 5 %}{% break %}{% endif %}
<{{ message['role'] }} {{ loop.index }}>
{{ message['content'] | trim }}
    {% if loop.last %}[last]{% endif %}
{{ eos_token }}
{% endfor %}
{%- if add_generation_prompt %}<assistant>{% endif %}
count={{ ns.n }}"""


@functools.lru_cache(maxsize=None)
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def hf_render(model_dir, messages, add_generation_prompt=True, tools=None):
    tok = hf_tokenizer(model_dir)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                   tools=tools)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_render_matches_transformers(llama_dir, name, add_generation_prompt):
    ours = Tokenizer(llama_dir).render_chat(CONVERSATIONS[name], add_generation_prompt=add_generation_prompt)
    assert ours == hf_render(llama_dir, CONVERSATIONS[name], add_generation_prompt)
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chatml_exact_text(llama_dir):
    ours = Tokenizer(llama_dir).render_chat(CONVERSATIONS["system"])
    assert ours == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tricky_dir(llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("tricky")
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(llama_dir / name, d / name)
    cfg = json.loads((llama_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TRICKY_TEMPLATE
    cfg["bos_token"] = {"content": "<|im_start|>", "special": True, "__type": "AddedToken"}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tricky_template_matches_transformers(tricky_dir, name, add_generation_prompt):
    tok = Tokenizer(tricky_dir)
    assert tok.bos_token == "<|im_start|>"  # AddedToken dicts are read as their content
    ours = tok.render_chat(CONVERSATIONS[name], add_generation_prompt=add_generation_prompt)
    assert ours == hf_render(tricky_dir, CONVERSATIONS[name], add_generation_prompt)


def test_tricky_template_with_tools_matches_transformers(tricky_dir):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter ☀",
                                               "parameters": {"type": "object", "properties": {}}}}]
    msgs = CONVERSATIONS["single_user"]
    ours = Tokenizer(tricky_dir).render_chat(msgs, tools=tools)
    assert "get_weather" in ours and "☀" in ours
    assert ours == hf_render(tricky_dir, msgs, tools=tools)


def test_template_raise_exception_becomes_invalid_request(tricky_dir):
    with pytest.raises(InvalidRequestError, match="bad role tool") as err:
        Tokenizer(tricky_dir).render_chat([{"role": "tool", "content": "x"}])
    assert err.value.param == "messages"


def test_chat_template_file_overrides_and_named_templates(llama_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(llama_dir / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((llama_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOL"},
                            {"name": "default", "template": "DEFAULT {{ messages|length }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer(d).render_chat(CONVERSATIONS["system"]) == "DEFAULT 2"
    (d / "chat_template.jinja").write_text("FILE {{ messages[0]['content'] }}")
    assert Tokenizer(d).render_chat(CONVERSATIONS["system"]) == "FILE You are terse."


def test_missing_template_and_broken_files(llama_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(llama_dir / "tokenizer.json", d / "tokenizer.json")
    tok = Tokenizer(d)  # no tokenizer_config.json at all
    assert tok.chat_template is None and tok.eos_token is None
    with pytest.raises(InvalidRequestError):
        tok.render_chat(CONVERSATIONS["system"])
    with pytest.raises(ModelLoadError):
        Tokenizer(tmp_path / "absent")
    (d / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelLoadError):
        Tokenizer(d)
    with pytest.raises(ModelLoadError):
        ChatTemplate("{% for x in %}", {})


def test_encode_decode_roundtrip_and_specials(llama_dir):
    tok = Tokenizer(llama_dir)
    hf = hf_tokenizer(llama_dir)
    text = Tokenizer(llama_dir).render_chat(CONVERSATIONS["multi_turn"])
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    im_start, im_end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
    assert ids.count(im_start) == 5 and ids.count(im_end) == 4  # specials are single tokens
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert "<|im_end|>" not in tok.decode(ids)
    assert tok.vocab_size == len(hf) == 420
    assert tok.token_id("no-such-token") is None
    assert tok.token_id(None) is None


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_matches_transformers(smollm2_dir, name, add_generation_prompt):
    ours = Tokenizer(smollm2_dir).render_chat(CONVERSATIONS[name], add_generation_prompt=add_generation_prompt)
    assert ours == hf_render(smollm2_dir, CONVERSATIONS[name], add_generation_prompt)
    if name == "single_user":  # SmolLM2 adds its default system prompt
        assert ours.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_smollm2_encoding_matches_transformers(smollm2_dir):
    hf = hf_tokenizer(smollm2_dir)
    tok = Tokenizer(smollm2_dir)
    for msgs in CONVERSATIONS.values():
        text = tok.render_chat(msgs)
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False)
