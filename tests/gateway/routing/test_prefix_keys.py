"""Prefix keys: an agent's next turn finds its previous turn's key; tenants, models and
tools never share one."""

from __future__ import annotations

from kvrelay.gateway.routing.prefix_keys import MAX_KEYS, TEXT_CHUNK_CHARS, prefix_keys

SYSTEM = {"role": "system", "content": "You are the reviewer."}
TASK = {"role": "user", "content": "Review the passage."}


def chat(*messages, **extra):
    return {"model": "m", "messages": list(messages), **extra}


def test_a_later_turn_starts_with_the_earlier_turns_keys():
    first = prefix_keys(chat(SYSTEM, TASK), None)
    later = prefix_keys(chat(SYSTEM, TASK, {"role": "assistant", "content": "Fine."}, {"role": "user",
                                                                                      "content": "Again."}), None)
    assert len(first) == 2 and len(later) == 4
    assert later[:2] == first
    assert [k.chars for k in later] == sorted(k.chars for k in later)  # characters covered grow


def test_another_agent_shares_the_key_of_the_same_system_message_only():
    a = prefix_keys(chat(SYSTEM, TASK), None)
    b = prefix_keys(chat(SYSTEM, {"role": "user", "content": "Something else."}), None)
    assert a[0] == b[0] and a[1] != b[1]


def test_salt_model_and_tools_start_other_chains():
    base = prefix_keys(chat(SYSTEM), None)[0].key
    assert prefix_keys(chat(SYSTEM), "tenant-b")[0].key != base
    assert prefix_keys({**chat(SYSTEM), "model": "other"}, None)[0].key != base
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert prefix_keys(chat(SYSTEM, tools=tools), None)[0].key != base
    assert prefix_keys(chat(SYSTEM), None)[0].key == base  # and the same request keys the same


def test_a_completion_prompt_is_keyed_per_chunk():
    text = "x" * (2 * TEXT_CHUNK_CHARS + 5)
    keys = prefix_keys({"model": "m", "prompt": text}, None)
    assert [k.chars for k in keys] == [TEXT_CHUNK_CHARS, 2 * TEXT_CHUNK_CHARS, 2 * TEXT_CHUNK_CHARS + 5]
    assert prefix_keys({"model": "m", "prompt": text + "y"}, None)[:2] == keys[:2]


def test_unreadable_prompts_have_no_keys_and_odd_text_does_not_fail():
    assert prefix_keys({"model": "m", "prompt": [1, 2, 3]}, None) == []
    assert prefix_keys({"model": "m"}, None) == []
    assert len(prefix_keys(chat({"role": "user", "content": "\ud800 lone surrogate"}), None)) == 1
    assert len(prefix_keys(chat({"role": "user", "content": {"nested": [None, 1.5]}}), None)) == 1


def test_a_very_long_conversation_keeps_its_first_and_last_keys():
    messages = [{"role": "user", "content": str(i)} for i in range(MAX_KEYS + 100)]
    keys = prefix_keys(chat(*messages), None)
    assert len(keys) == MAX_KEYS
    assert keys[-1] == prefix_keys(chat(*messages), None)[-1] and keys[0] == prefix_keys(chat(messages[0]), None)[0]
