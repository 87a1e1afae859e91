"""identify(): session, agent and app from headers, then body fields, first hit wins;
blank and non-string values skipped, ids cut to 128 characters."""

from __future__ import annotations

from kvrelay.gateway.identity import DEFAULT_APP, SESSION_HEADERS, Identity, identify

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def body(**fields: object) -> dict:
    return {**CHAT, **fields}


def test_nothing_given_yields_default_app_and_no_ids():
    assert identify({}, CHAT) == Identity("default", None, None)
    assert DEFAULT_APP == "default"


def test_session_headers_follow_their_precedence_order():
    headers = {h: f"s-{h}" for h in SESSION_HEADERS}
    for header in SESSION_HEADERS:
        assert identify(headers, CHAT).session_id == f"s-{header}"
        del headers[header]
    assert identify(headers, CHAT).session_id is None


def test_kvrelay_session_header_beats_claude_code_header():
    headers = {"x-claude-code-session-id": "cc", "x-kvrelay-session-id": "ours"}
    assert identify(headers, CHAT).session_id == "ours"


def test_litellm_session_header_alone_is_used():
    assert identify({"x-litellm-session-id": "lite"}, CHAT).session_id == "lite"


def test_session_header_beats_body_fields():
    b = body(prompt_cache_key="pck", metadata={"session_id": "meta"}, user="u")
    assert identify({"x-session-id": "hdr"}, b).session_id == "hdr"


def test_prompt_cache_key_beats_metadata_session_and_user():
    b = body(prompt_cache_key="pck", metadata={"session_id": "meta"}, user="u")
    assert identify({}, b).session_id == "pck"


def test_metadata_session_id_beats_user():
    b = body(metadata={"session_id": "meta"}, user="u")
    assert identify({}, b).session_id == "meta"


def test_user_is_the_last_session_fallback():
    assert identify({}, body(user="alice")).session_id == "alice"


def test_whitespace_only_session_values_are_skipped():
    headers = {"x-kvrelay-session-id": "   ", "x-session-id": "\t\n"}
    b = body(prompt_cache_key="  ", metadata={"session_id": " "}, user=" bob ")
    assert identify(headers, b).session_id == "bob"


def test_session_values_are_stripped():
    assert identify({"x-kvrelay-session": "  abc  "}, CHAT).session_id == "abc"


def test_non_string_session_values_are_skipped():
    b = body(prompt_cache_key=123, metadata={"session_id": ["x"]}, user="carol")
    assert identify({}, b).session_id == "carol"


def test_non_dict_metadata_is_ignored():
    b = body(metadata="session-in-a-string", user="dave")
    assert identify({}, b) == Identity("default", "dave", None)


def test_ids_are_truncated_to_128_chars():
    long = "s" * 200
    ident = identify({"x-kvrelay-session-id": long, "x-agent-id": "a" * 129, "x-client-id": "c" * 300}, CHAT)
    assert ident == Identity("c" * 128, "s" * 128, "a" * 128)


def test_id_of_exactly_128_chars_is_kept_whole():
    assert identify({}, body(user="u" * 128)).session_id == "u" * 128


def test_truncation_applies_after_stripping():
    value = "  " + "x" * 130
    assert identify({}, body(user=value)).session_id == "x" * 128


def test_agent_header_kvrelay_beats_generic():
    headers = {"x-agent-id": "generic", "x-kvrelay-agent-id": "ours"}
    assert identify(headers, CHAT).agent_id == "ours"


def test_generic_agent_header_beats_body():
    b = body(metadata={"agent_id": "meta"})
    assert identify({"x-agent-id": "hdr"}, b).agent_id == "hdr"


def test_metadata_agent_id_beats_system_name():
    b = {"messages": [{"role": "system", "name": "Planner", "content": "x"}], "metadata": {"agent_id": "meta"}}
    assert identify({}, b).agent_id == "meta"


def test_system_message_name_is_the_agent_fallback():
    b = {"messages": [{"role": "system", "name": "Planner", "content": "x"},
                      {"role": "user", "name": "Human", "content": "hi"}]}
    assert identify({}, b).agent_id == "Planner"


def test_developer_message_name_counts_as_system():
    b = {"messages": [{"role": "developer", "name": "Coder", "content": "x"}]}
    assert identify({}, b).agent_id == "Coder"


def test_user_message_name_is_not_an_agent():
    b = {"messages": [{"role": "user", "name": "Human", "content": "hi"}]}
    assert identify({}, b).agent_id is None


def test_blank_or_non_string_agent_values_are_skipped():
    b = {"messages": [{"role": "system", "name": 7, "content": "x"}], "metadata": {"agent_id": " "}}
    assert identify({"x-kvrelay-agent-id": "  "}, b).agent_id is None


def test_non_list_messages_give_no_agent():
    assert identify({}, {"prompt": "hi", "messages": "oops"}).agent_id is None


def test_api_key_id_beats_app_headers():
    headers = {"x-kvrelay-app": "hdr-app", "x-client-id": "client"}
    assert identify(headers, CHAT, api_key_id="key-1").app_id == "key-1"


def test_kvrelay_app_header_beats_client_id():
    headers = {"x-kvrelay-app": "hdr-app", "x-client-id": "client"}
    assert identify(headers, CHAT).app_id == "hdr-app"


def test_client_id_header_is_the_app_fallback():
    assert identify({"x-kvrelay-app": " ", "x-client-id": "client"}, CHAT).app_id == "client"


def test_all_three_together():
    headers = {"x-kvrelay-session-id": "sess", "x-kvrelay-agent-id": "agent", "x-kvrelay-app": "app"}
    assert identify(headers, CHAT) == Identity("app", "sess", "agent")
