"""SegmentPlan v1: validation of segments and plans, and the round trip through
kv_transfer_params["kvrelay"] with attach_plan / read_plan."""

from __future__ import annotations

import copy
import hashlib
import json

import hypothesis
import pytest
from hypothesis import strategies as st
from pydantic import ValidationError

from kvrelay.wire.plan import (
    PLAN_KEY,
    PLAN_VERSION,
    AdapterRef,
    RoundInfo,
    Segment,
    SegmentPlan,
    WorkflowInfo,
    attach_plan,
    plan_text,
    read_plan,
)

SYSTEM = "You are the planner. Today is Monday."
HASH = hashlib.sha256(b"x").hexdigest()


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def seg(start: int, end: int, kind: str = "private", message_index: int = 0, **extra: object) -> Segment:
    return Segment(message_index=message_index, char_start=start, char_end=end, kind=kind,
                   content_hash=sha(SYSTEM[start:end]), **extra)


def plan(segments: list[Segment] | None = None, **extra: object) -> SegmentPlan:
    if segments is None:
        segments = [seg(0, 30, "fixed_prefix", name="planner"), seg(30, 37),
                    seg(0, 5, "placeholder", message_index=1, name="agent_coder_current", source_request="req-0")]
    return SegmentPlan(session_id="sess", agent_id="planner", request_id="req-1", segments=segments, **extra)


def plan_dict(**overrides: object) -> dict:
    return {**plan().model_dump(mode="json"), **overrides}


def test_constants():
    assert (PLAN_VERSION, PLAN_KEY) == (1, "kvrelay")


def test_plan_defaults():
    p = plan()
    assert (p.version, p.round, p.workflow, p.adapter) == (1, None, None, None)


def test_plan_round_trips_through_attach_and_read_via_json():
    p = plan(round=RoundInfo(id="r1", size=3, index=2),
             workflow=WorkflowInfo(steps_to_execution={"coder": 1, "planner": 0}, next=["coder"]),
             adapter=AdapterRef(base="m", name="lora-a"))
    body = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}]}
    wire = json.loads(json.dumps(attach_plan(body, p)))
    assert read_plan(wire) == p
    assert wire["kv_transfer_params"][PLAN_KEY]["segments"][2] == {
        "message_index": 1, "char_start": 0, "char_end": 5, "kind": "placeholder",
        "name": "agent_coder_current", "content_hash": sha(SYSTEM[0:5]), "source_request": "req-0",
        "method": None}


def test_attach_plan_keeps_other_kv_transfer_params_entries():
    body = {"model": "m", "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h"}}
    out = attach_plan(body, plan())
    assert out["kv_transfer_params"] == {"do_remote_prefill": True, "remote_host": "h",
                                         PLAN_KEY: plan().model_dump(mode="json")}
    assert out["model"] == "m"


def test_attach_plan_does_not_mutate_the_input_body():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": {"k": 1}}
    before = copy.deepcopy(body)
    out = attach_plan(body, plan())
    assert body == before
    assert out is not body
    assert out["kv_transfer_params"] is not body["kv_transfer_params"]


def test_attach_plan_replaces_a_non_dict_kv_transfer_params():
    out = attach_plan({"model": "m", "kv_transfer_params": "junk"}, plan())
    assert list(out["kv_transfer_params"]) == [PLAN_KEY]


def test_attach_plan_replaces_an_existing_plan():
    first = attach_plan({"model": "m"}, plan(adapter=AdapterRef(base="m", name="old")))
    second = attach_plan(first, plan(adapter=AdapterRef(base="m")))
    assert read_plan(second).adapter == AdapterRef(base="m")
    assert read_plan(first).adapter == AdapterRef(base="m", name="old")


def test_adapter_ref_names_the_model_and_travels_as_base_and_name():
    assert AdapterRef(base="smollm2-135m").model == "smollm2-135m"
    assert AdapterRef(base="smollm2-135m", name="math").model == "smollm2-135m:math"
    wire = json.loads(json.dumps(attach_plan({}, plan(adapter=AdapterRef(base="b", name="a")))))
    assert wire["kv_transfer_params"][PLAN_KEY]["adapter"] == {"base": "b", "name": "a"}
    for bad in ({"base": ""}, {"base": "b", "name": ""}, {"base": "b", "extra": 1}):
        with pytest.raises(ValidationError):
            AdapterRef.model_validate(bad)
    # Plans from older gateways carried the model name as a string.
    assert SegmentPlan.model_validate(plan_dict(adapter="m")).adapter == AdapterRef(base="m")
    assert SegmentPlan.model_validate(plan_dict(adapter="llama3:8b:math")).adapter == AdapterRef(base="llama3:8b",
                                                                                                name="math")


def test_read_plan_returns_none_when_absent():
    assert read_plan({"model": "m"}) is None
    assert read_plan({"model": "m", "kv_transfer_params": {"other": 1}}) is None
    assert read_plan({"model": "m", "kv_transfer_params": None}) is None
    assert read_plan({"model": "m", "kv_transfer_params": ["kvrelay"]}) is None


def test_read_plan_raises_on_a_malformed_plan():
    with pytest.raises(ValidationError):
        read_plan({"kv_transfer_params": {PLAN_KEY: {"version": 1}}})


def test_empty_segment_is_rejected():
    with pytest.raises(ValidationError, match=r"segment \[5, 5\) is empty"):
        seg(5, 5)


def test_reversed_segment_is_rejected():
    with pytest.raises(ValidationError, match="is empty"):
        seg(6, 5)


def test_negative_offsets_are_rejected():
    with pytest.raises(ValidationError):
        Segment(message_index=0, char_start=-1, char_end=3, kind="private", content_hash=HASH)
    with pytest.raises(ValidationError):
        Segment(message_index=-1, char_start=0, char_end=3, kind="private", content_hash=HASH)


def test_placeholder_without_name_is_rejected():
    with pytest.raises(ValidationError, match="placeholder segment needs a name"):
        seg(0, 5, "placeholder")
    with pytest.raises(ValidationError, match="placeholder segment needs a name"):
        seg(0, 5, "placeholder", name="")


def test_shared_block_without_name_is_accepted():
    assert seg(0, 5, "shared_block").name is None


def test_unknown_kind_is_rejected():
    with pytest.raises(ValidationError):
        seg(0, 5, "dense")


def test_overlapping_segments_are_rejected():
    with pytest.raises(ValidationError, match="in order and must not overlap"):
        plan([seg(0, 10), seg(9, 20)])


def test_out_of_order_segments_are_rejected():
    with pytest.raises(ValidationError, match="in order and must not overlap"):
        plan([seg(10, 20), seg(0, 10)])


def test_out_of_order_messages_are_rejected():
    with pytest.raises(ValidationError, match="in order and must not overlap"):
        plan([seg(0, 5, message_index=1), seg(0, 5, message_index=0)])


def test_adjacent_segments_and_later_messages_are_accepted():
    p = plan([seg(0, 10), seg(10, 20), seg(0, 3, message_index=1)])
    assert [(s.message_index, s.char_start, s.char_end) for s in p.segments] == [(0, 0, 10), (0, 10, 20), (1, 0, 3)]


def test_empty_segment_list_is_accepted():
    assert plan([]).segments == []


@pytest.mark.parametrize("bad", ["a" * 63, "a" * 65, "A" * 64, "g" * 64, "a" * 64 + "\n", ""])
def test_bad_content_hash_is_rejected(bad: str):
    with pytest.raises(ValidationError):
        Segment(message_index=0, char_start=0, char_end=1, kind="private", content_hash=bad)


def test_sha256_hex_content_hash_is_accepted():
    abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # sha256(b"abc")
    assert sha("abc") == abc
    assert Segment(message_index=0, char_start=0, char_end=3, kind="private", content_hash=abc).content_hash == abc


@pytest.mark.parametrize("version", [0, 2, "2"])
def test_version_other_than_one_is_rejected(version: object):
    with pytest.raises(ValidationError):
        SegmentPlan.model_validate(plan_dict(version=version))


def test_extra_plan_field_is_rejected():
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        SegmentPlan.model_validate(plan_dict(priority=5))


def test_extra_segment_field_is_rejected():
    data = plan_dict()
    data["segments"][0]["tokens"] = [1, 2, 3]
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        SegmentPlan.model_validate(data)


def test_round_size_below_one_is_rejected():
    with pytest.raises(ValidationError):
        RoundInfo(id="r", size=0, index=0)


def test_models_are_frozen():
    p = plan()
    with pytest.raises(ValidationError):
        p.session_id = "other"  # type: ignore[misc]


@hypothesis.given(ids=st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6), min_size=4,
                               max_size=4), with_segment=st.booleans())
@hypothesis.settings(max_examples=300, deadline=None, database=None)
def test_plan_text_is_model_dump_json(ids, with_segment):
    """The record keeps plan_text(values): it must be the text model_dump_json gives."""
    session, agent, name, step = ids
    segments = [Segment(message_index=0, char_start=0, char_end=3, kind="placeholder", name=name or "n", content_hash=HASH,
                        source_request=agent)] if with_segment else []
    p = SegmentPlan(session_id=session, agent_id=agent, request_id="r\u2028\x7f\x01\"\\", segments=segments,
                    workflow=WorkflowInfo(steps_to_execution={step: 1}, next=[step]), app_id=name or None,
                    tenant=session or None, round=RoundInfo(id=agent, size=2, index=1))
    assert plan_text(p.model_dump(mode="json")) == p.model_dump_json()
