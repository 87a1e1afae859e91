"""The user question found inside each agent's own template."""

from __future__ import annotations

from gateway.identity import identify
from gateway.inference import Inference
from gateway.inference.question import common_core
from gateway.settings import InferenceSettings

QUESTION = "A train leaves Leeds at 9:40 and reaches York at 10:07; how many minutes does the trip take?"


def test_common_core_is_whole_words_and_long_enough():
    core = common_core(f"Math expert, solve this: {QUESTION} Give one number.",
                       f"As the checker, verify: {QUESTION} Explain briefly.", min_chars=32)
    assert core is not None
    q = f"Math expert, solve this: {QUESTION} Give one number."
    assert q[core.start:core.end] == QUESTION
    msg = f"As the checker, verify: {QUESTION} Explain briefly."
    assert msg[core.message_start:core.message_start + core.end - core.start] == QUESTION
    assert common_core(QUESTION, "Something else entirely, about the weather in Leeds today.", 32) is None


def test_a_cut_inside_a_word_moves_to_the_word_boundary():
    core = common_core("xxsolve the trains puzzle now please", "yysolve the trains puzzle now pleasz", 8)
    assert core is not None
    assert "xxsolve the trains puzzle now please"[core.start:core.end] == "the trains puzzle now"


def _plan(inference: Inference, system: str, user: str):
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    return body, inference.plan(identify({"x-session-id": "s"}, body, None), body, "r", "m").plan


def test_a_question_wrapped_in_each_agents_template_becomes_one_placeholder():
    inference = Inference(InferenceSettings())
    _plan(inference, "You are the math expert of the team.", f"Solve this task: {QUESTION} Answer with a number.")
    templates = [f"Check the solution to the task below.\nTask: {QUESTION}\nBe brief.",
                 f"Here is the problem. {QUESTION} Explain each step."]
    for i, user in enumerate(templates):
        body, plan = _plan(inference, f"You are agent {i} of the team, a careful checker.", user)
        [question] = [s for s in plan.segments if s.name == "user_question"]
        assert body["messages"][1]["content"][question.char_start:question.char_end] == QUESTION
    assert {s.content_hash for s in plan.segments if s.name == "user_question"} == {
        __import__("hashlib").sha256(QUESTION.encode()).hexdigest()}


def test_a_group_chat_initiator_named_by_the_framework_brings_the_question():
    inference = Inference(InferenceSettings())
    task = {"role": "user", "name": "User_proxy", "content": QUESTION}
    first = {"messages": [{"role": "system", "content": "You are the chat manager. Pick who speaks next."}, task]}
    plan = inference.plan(identify({}, first, None), first, "r1", "m").plan
    assert [s.name for s in plan.segments if s.kind == "placeholder"] == ["user_question"]
    second = {"messages": [{"role": "system", "content": "You are the Engineer. Write the code."}, task]}
    again = inference.plan(identify({}, second, None), second, "r2", "m").plan
    assert again.session_id == plan.session_id  # linked through the question
