"""The user question found inside each agent's own template."""

from __future__ import annotations

import random

import pytest

from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference
from kvrelay.gateway.inference.question import MAX_MESSAGE_CHARS, MAX_PLACES_PER_WINDOW, MAX_QUESTION_CHARS, common_core
from kvrelay.gateway.settings import InferenceSettings
from tests.helpers import LINEAR_RATIO_BOUND, cpu_ratio

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


# -- against the definition, and linear whatever the text -------------------------------------

def _longest_whole_words(question: str, message: str, min_chars: int) -> tuple[int, int, int] | None:
    """By brute force: every run of whole words of the question, longest (then earliest)
    first, that the message contains; where the message holds it first."""
    starts = [i for i, c in enumerate(question) if not c.isspace() and (i == 0 or question[i - 1].isspace())]
    ends = [j for j in range(1, len(question) + 1)
            if not question[j - 1].isspace() and (j == len(question) or question[j].isspace())]
    runs = sorted(((a, b) for a in starts for b in ends if b > a), key=lambda r: (r[0] - r[1], r[0]))
    need = max(min_chars, 0.5 * len(question.strip()))
    for a, b in runs:
        if b - a < need:
            return None
        if question[a:b] in message:
            return a, b, message.find(question[a:b])
    return None


def test_common_core_is_the_longest_whole_word_run_the_message_holds():
    """Messages of at most MAX_PLACES_PER_WINDOW characters, so no window of the question
    has more places than are searched: the answer must be exact."""
    rng = random.Random(5)
    found = 0
    for _ in range(5000):
        alphabet = rng.choice(["ab ", "a ", "abc  \n", "xy", "ab\u00a0"])
        question = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 24)))
        if question and rng.random() < 0.7:  # the message wraps part of the question
            a = rng.randrange(len(question) // 2 + 1)
            part = question[a:rng.randrange(a, len(question) + 1)]
            message = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 3))) + part
            message += "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 3)))
        else:
            message = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 16)))
        message = message[:MAX_PLACES_PER_WINDOW]
        min_chars = rng.choice([1, 2, 4, 8])
        core = common_core(question, message, min_chars)
        expected = _longest_whole_words(question, message, min_chars)
        assert (tuple(core) if core else None) == expected, (question, message, min_chars)
        found += expected is not None
    assert found > 500


ADVERSARIAL = {
    "one character": lambda n: ("a" * (n // 8), "a" * n),
    "a short pattern": lambda n: (("ab" * n)[: n // 8], ("ab" * n)[:n]),
    "one word repeated": lambda n: (("go " * n)[: n // 8], ("go " * n)[:n]),
    "the question inside padding": lambda n: ("word " * (n // 40), "x" * (n // 2) + "word " * (n // 40) + "y" * (n // 2)),
    "almost the question": lambda n: ("a" * (n // 16) + "b" + "a" * (n // 16), "a" * n),
}


@pytest.mark.parametrize("shape", ADVERSARIAL)
def test_common_core_takes_linear_time_on_adversarial_text(shape):
    def run(n: int):
        question, message = ADVERSARIAL[shape](n)
        return lambda: common_core(question, message[:MAX_MESSAGE_CHARS], 32)

    ratio = cpu_ratio(run(8_000), run(32_000))
    assert ratio < LINEAR_RATIO_BOUND, f"4x the text took {ratio:.1f}x the time"


def test_the_message_is_searched_up_to_its_cap_and_a_long_question_is_not_narrowed():
    assert common_core(QUESTION, "x" * MAX_MESSAGE_CHARS + QUESTION, 32) is None
    assert common_core(QUESTION, "x" * (MAX_MESSAGE_CHARS - len(QUESTION)) + QUESTION, 32) is not None
    long_question = "word " * (MAX_QUESTION_CHARS // 5 + 1)
    assert common_core(long_question, long_question, 32) is None
