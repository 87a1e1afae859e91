"""Structure inference under hostile prompts: hypothesis-generated messages never make
planning fail, and adversarial shapes (megabytes of one character, thousands of tiny
messages, nested and repeated delimiters) take time at most linear in their size.

Linearity is asserted as a complexity ratio, not a wall-time bound: the same input shape
at 4x the size must take well under 16x (quadratic) the CPU time; linear is 4x, and the
bound of 8x leaves room for a noisy machine. Each side is the best of three runs."""

from __future__ import annotations

from collections.abc import Callable

import hypothesis
import pytest
from hypothesis import strategies as st

from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference
from kvrelay.gateway.inference.planner import PlanResult
from kvrelay.gateway.settings import InferenceSettings
from tests.helpers import LINEAR_RATIO_BOUND, cpu_ratio



def plan_once(messages: list[dict], session: str = "s") -> PlanResult:
    inference = Inference(InferenceSettings())
    body = {"messages": messages}
    return inference.plan(identify({"x-session-id": session}, body, None), body, "r", "m")


def assert_linear(build: Callable[[int], list[dict]], n: int) -> None:
    small, large = build(n), build(4 * n)
    ratio = cpu_ratio(lambda: plan_once(small), lambda: plan_once(large))
    assert ratio < LINEAR_RATIO_BOUND, f"4x the input took {ratio:.1f}x the time"


SHAPES = {
    "one repeated character": lambda n: [{"role": "user", "content": "a" * n}],
    "thousands of tiny messages": lambda n: [{"role": "user" if i % 2 else "assistant", "content": "hi"}
                                             for i in range(n // 100)],
    "repeated separators": lambda n: [{"role": "user", "content": "<TTSEP>" * (n // 7)}],
    "nested kv delimiters": lambda n: [{"role": "user",
                                        "content": "<kv_start>" * (n // 20) + "x" + "<kv_end>" * (n // 20)}],
    "a system prompt of one word repeated": lambda n: [{"role": "system", "content": "agent " * (n // 6)},
                                                       {"role": "user", "content": "go"}],
}


@pytest.mark.parametrize("shape", SHAPES)
def test_adversarial_prompts_take_linear_time(shape):
    assert_linear(SHAPES[shape], 250_000)


def test_a_megabyte_of_one_character_is_planned():
    result = plan_once([{"role": "user", "content": "z" * 2**20}])
    assert result.plan is not None and result.plan.session_id == "s" and not result.over_budget
    # The whole message is one segment: nothing cut short, split or left out.
    assert [(s.message_index, s.char_start, s.char_end) for s in result.plan.segments] == [(0, 0, 2**20)]


_PIECES = [*"ab <>/_\n", "<TTSEP>", "<kv_start>", "<kv_end>", "é", "\x00", "You are the planner. ", "answer 1 "]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=120).map("".join)
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", ""]),
                                  "content": st.one_of(_TEXT, st.none(), st.integers(), st.lists(st.dictionaries(
                                      st.sampled_from(["type", "text"]), _TEXT), max_size=3))})


@hypothesis.given(conversation=st.lists(st.lists(_MESSAGE, min_size=1, max_size=8), min_size=1, max_size=4))
@hypothesis.settings(max_examples=150, deadline=None, database=None)
def test_any_messages_are_planned_and_every_segment_lies_in_its_message(conversation):
    inference = Inference(InferenceSettings(anchor_chars=8))
    for i, messages in enumerate(conversation):
        body = {"messages": messages}
        plan = inference.plan(identify({"x-session-id": "s"}, body, None), body, f"r{i}", "m").plan
        for segment in plan.segments:
            content = messages[segment.message_index]["content"]
            assert isinstance(content, str) and 0 <= segment.char_start < segment.char_end <= len(content)
        inference.observe_response("default", "s", plan.agent_id or "a", f"r{i}", f"answer {i} " * 5)


def _unbudgeted(**settings) -> Inference:
    """Planning without the time budget, so a complexity ratio sees all the work."""
    return Inference(InferenceSettings(plan_budget_ms=1000, **settings))


def test_thousands_of_blocks_are_planned_in_linear_time():
    def run(num_blocks: int) -> Callable[[], None]:
        content = "<TTSEP>".join(f"block {i:06d} of the long survey of the harbour" for i in range(num_blocks))
        body = {"messages": [{"role": "user", "content": content}]}
        return lambda: _unbudgeted().plan(identify({"x-session-id": "s"}, body, None), body, "r", "m")

    ratio = cpu_ratio(run(800), run(3_200))
    assert ratio < LINEAR_RATIO_BOUND, f"4x the blocks took {ratio:.1f}x the time"


def test_a_prompt_quoting_thousands_of_one_agents_outputs_is_planned_in_linear_time():
    def run(num_outputs: int) -> Callable[[], None]:
        inference = _unbudgeted(max_plan_segments=4096)
        outputs = [f"Output {i:05d} of the scribe: the granary holds {i} sacks." for i in range(num_outputs)]
        for i, output in enumerate(outputs):
            inference.observe_response("default", "s", "scribe", f"r{i}", output)
        body = {"messages": [{"role": "user", "content": "\n".join(outputs)}]}
        return lambda: inference.plan(identify({"x-session-id": "s"}, body, None), body, "q", "m")

    ratio = cpu_ratio(run(500), run(2_000))
    assert ratio < LINEAR_RATIO_BOUND, f"4x the quoted outputs took {ratio:.1f}x the time"
