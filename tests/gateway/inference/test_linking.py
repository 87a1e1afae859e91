"""Sessions linked from content alone, and the placeholders found in real traffic's shapes:
repeated runs of one task, identical outputs in two sessions, tool-call ids, short tool
results, outputs quoted with or without their trailing whitespace."""

from __future__ import annotations

from typing import Any

from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference, PlanResult
from kvrelay.gateway.inference.state import TextRef
from kvrelay.gateway.settings import InferenceSettings

TASK = "Plan a three-day trip to Lisbon on a small budget, with one museum a day."
PLANNER = "You are the planner. Break the task into steps."
WRITER = "You are the writer. Turn the plan into a friendly answer."
PLAN = "Day one: the castle and Alfama. Day two: Belem and its tower. Day three: the tile museum."


class App:
    """One app's traffic through one Inference, as the gateway sees it (no session header)."""

    def __init__(self) -> None:
        self.inference = Inference(InferenceSettings())
        self.n = 0

    def ask(self, system: str | None, *messages: dict[str, Any], answer: str = "",
            calls: tuple[str, ...] = ()) -> PlanResult:
        body = {"model": "m", "messages": ([{"role": "system", "content": system}] if system else []) + list(messages)}
        self.n += 1
        result = self.inference.plan(identify({}, body), body, f"r{self.n}", "m")
        self.inference.observe_response("default", result.session_id, result.agent_id, f"r{self.n}", answer, calls)
        return result


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def placeholders(result: PlanResult) -> list[tuple[int, int, int, str | None]]:
    return [(s.message_index, s.char_start, s.char_end, s.name) for s in result.plan.segments if s.kind == "placeholder"]


def test_a_new_run_of_the_same_task_is_a_new_session_and_its_answers_stay_in_it():
    app = App()
    first = app.ask(PLANNER, user(TASK), answer=PLAN)
    first_writer = app.ask(WRITER, user(TASK), user(PLAN), answer="Enjoy Lisbon!")
    assert first_writer.session_id == first.session_id
    again = app.ask(PLANNER, user(TASK), answer=PLAN)  # the planner asked this session already: a new run
    assert again.session_id != first.session_id
    writer = app.ask(WRITER, user(TASK), user(PLAN))  # the same plan in both sessions: the newer run goes on
    assert writer.session_id == again.session_id


def test_a_prompt_that_holds_only_the_task_joins_the_session_of_another_agent():
    app = App()
    first = app.ask(PLANNER, user(TASK))
    assert app.ask(WRITER, user(TASK)).session_id == first.session_id  # a round's second agent, not a new run


def test_an_agent_that_goes_on_after_its_question_stays_in_its_session():
    app = App()
    first = app.ask(PLANNER, user(TASK), answer=PLAN)
    later = app.ask(PLANNER, user(TASK), {"role": "assistant", "content": PLAN}, user("Shorter, please."))
    assert later.session_id == first.session_id


def test_a_tool_call_id_continues_the_session_whose_answer_made_the_call():
    app = App()
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_9f2", "type": "function", "function": {"name": "stock", "arguments": "{}"}}]}
    first = app.ask(PLANNER, user(TASK), calls=("call_9f2",))
    app.ask(PLANNER, user(TASK), answer=PLAN)  # a second run of the task, more recent
    tool = {"role": "tool", "tool_call_id": "call_9f2", "content": "214"}
    result = app.ask(PLANNER, user(TASK), call, tool)
    assert result.session_id == first.session_id
    assert (3, 0, 3) in [p[:3] for p in placeholders(result)]  # the short tool result, as a whole message


def test_a_short_text_is_a_placeholder_as_a_whole_message_and_never_inside_one():
    app = App()
    tool = {"role": "tool", "tool_call_id": "c1", "content": "911.872"}
    first = app.ask(PLANNER, user(TASK), tool, answer="About 912.")
    assert (2, 0, 7, f"condition_{first.agent_id}_current") in placeholders(first)
    again = app.ask(PLANNER, user(TASK), tool, {"role": "assistant", "content": "About 912."},
                    user("Is 911.872 exact? About 912."))
    found = placeholders(again)
    assert (2, 0, 7) in [p[:3] for p in found] and (3, 0, 10) in [p[:3] for p in found]
    assert not [p for p in found if p[0] == 4]  # the same strings inside a longer message are not quoted


def test_an_answer_of_sixteen_characters_or_more_is_found_inside_a_message_as_whole_words():
    app = App()
    first = app.ask(PLANNER, user(TASK), answer="The answer is 12")
    name = f"agent_{first.agent_id}_current"
    found = placeholders(app.ask(WRITER, user(TASK), user("Agent 1 said: The answer is 12.\nCheck it.")))
    assert (2, 14, 30, name) in found
    inside = placeholders(app.ask(WRITER, user(TASK), user("Agent 1 said: The answer is 123.")))
    assert not [p for p in inside if p[0] == 2]  # not inside a longer word


def test_an_answer_is_found_with_its_trailing_whitespace_or_without_it():
    app = App()
    first = app.ask(PLANNER, user(TASK), answer=PLAN + "  \n")
    kept = app.ask(WRITER, user(TASK), user(PLAN + "  \n"))
    stripped = app.ask(WRITER, user(TASK), user(PLAN))
    name = f"agent_{first.agent_id}_current"
    assert (2, 0, len(PLAN) + 3, name) in placeholders(kept)
    assert (2, 0, len(PLAN), name) in placeholders(stripped)
    assert kept.session_id == stripped.session_id == first.session_id


def test_the_question_inside_the_app_s_template_is_found_once_a_second_task_shows_the_wording():
    app = App()
    wrap = "The task is: {}\n\nAnswer step by step.".format
    other = "Is 91 a prime number? Explain why or why not."
    first = app.ask(PLANNER, user(wrap(TASK)), answer=PLAN)
    assert placeholders(first)[0][1:3] == (0, len(wrap(TASK)))  # one session shows no wording: all of it
    second = app.ask(PLANNER, user(wrap(other)))
    assert placeholders(second)[0][1:3] == (13, 13 + len(other))
    # The first session's question was narrowed with it: a new run of that task finds just the task.
    session = app.inference.apps["default"].sessions[first.session_id]
    assert app.inference.apps["default"].index.text_of(TextRef(first.session_id, session.question_seq)) == TASK
    rerun = app.ask(PLANNER, user(wrap(TASK)))
    assert rerun.session_id not in (first.session_id, second.session_id)
    assert placeholders(rerun)[0][1:3] == (13, 13 + len(TASK))


def test_tasks_that_merely_begin_alike_keep_their_words():
    app = App()
    app.ask(PLANNER, user("What is the weather in Rome tomorrow?"))
    result = app.ask(PLANNER, user("What is your shipping policy?"))
    assert placeholders(result)[0][1:3] == (0, len("What is your shipping policy?"))


def test_agents_that_kept_their_own_conversations_join_one_session_once_they_read_each_other():
    """An All-Gather app whose first round shares no text: each villager starts a session
    of its own; the first round-2 prompt that reads the others' answers joins them, and
    every later prompt finds every answer as a placeholder of that one session."""
    app = App()
    systems = [f"You are villager {i}, living in a small river town; you speak plainly." for i in range(3)]
    mornings = [f"Good morning, villager {i}. What will you do today in your own part of the town?" for i in range(3)]
    answers = [f"Villager {i}: I will mend the nets, then walk the dog along the river to the mill." for i in range(3)]
    first = [app.ask(systems[i], user(mornings[i]), answer=answers[i]) for i in range(3)]
    assert len({r.session_id for r in first}) == 3  # nothing shared yet
    later = []
    for i in range(3):
        others = "\n\n".join(answers[j] for j in range(3) if j != i)
        later.append(app.ask(systems[i], user(mornings[i]), {"role": "assistant", "content": answers[i]},
                             user(f"Your neighbours said:\n\n{others}")))
    (joined,) = {r.session_id for r in later}
    assert joined in {r.session_id for r in first}  # the one the first round-2 prompt continued
    assert {r.session_id for r in first} & set(app.inference.apps["default"].sessions) == {joined}  # merged away
    for i, result in enumerate(later[1:], start=1):
        names = {p[3] for p in placeholders(result)}
        assert {f"agent_{r.agent_id}_current" for r in first} <= names  # own answer and both neighbours'
    changes = app.inference.changes.take()
    assert {("default", r.session_id) for r in first if r.session_id != joined} <= changes.merged


def test_a_new_run_whose_answers_repeat_an_old_run_s_is_not_merged_with_it():
    app = App()
    old = app.ask(PLANNER, user(TASK), answer=PLAN)
    app.ask(WRITER, user(TASK), user(PLAN), answer="Enjoy Lisbon!")
    new = app.ask(PLANNER, user(TASK), answer=PLAN)  # the same answer again, in a new run
    writer = app.ask(WRITER, user(TASK), user(PLAN))
    assert writer.session_id == new.session_id != old.session_id
    assert old.session_id in app.inference.apps["default"].sessions
