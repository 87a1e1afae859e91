"""PrefixLearner: the fixed part of an agent's system prompt, learned from repeated prompts,
cut back to whitespace boundaries, or ended at once by an explicit delimiter; in time
linear in the prompt."""

from __future__ import annotations

import random

from kvrelay.gateway.inference.prefix import PrefixLearner, PrefixObservation, common_prefix_len
from tests.helpers import LINEAR_RATIO_BOUND, cpu_ratio

PLANNER = "You are the planner. Follow the rules below carefully."
MONDAY = "You are the planner. Today is Monday"
TUESDAY = "You are the planner. Today is Tuesday"
COMMON = "You are the planner. Today is "


def test_first_observation_returns_zero_and_sets_the_candidate():
    learner = PrefixLearner()
    assert learner.observe(PLANNER) == PrefixObservation(0, True)
    assert learner.candidate == PLANNER
    assert learner.hits == 1
    assert learner.fixed is None


def test_identical_prompt_is_fixed_on_the_second_observation():
    learner = PrefixLearner()
    learner.observe(PLANNER)
    assert learner.observe(PLANNER) == PrefixObservation(len(PLANNER), False)
    assert learner.fixed == PLANNER


def test_identical_prompts_need_min_hits_observations():
    learner = PrefixLearner(min_hits=3)
    learner.observe(PLANNER)
    assert learner.observe(PLANNER) == PrefixObservation(0, False)
    assert learner.fixed is None
    assert learner.observe(PLANNER) == PrefixObservation(len(PLANNER), False)
    assert learner.fixed == PLANNER


def test_prompt_extending_the_candidate_counts_as_a_hit():
    learner = PrefixLearner()
    learner.observe(PLANNER)
    assert learner.observe(PLANNER + " Extra tail.") == PrefixObservation(len(PLANNER), False)
    assert learner.candidate == PLANNER


def test_varying_tail_shrinks_candidate_to_a_whitespace_boundary():
    learner = PrefixLearner()
    learner.observe(MONDAY)
    assert learner.observe(TUESDAY) == PrefixObservation(len(COMMON), True)
    assert learner.candidate == COMMON
    assert learner.fixed == COMMON


def test_shrunk_candidate_keeps_hitting_without_change():
    learner = PrefixLearner()
    learner.observe(MONDAY)
    learner.observe(TUESDAY)
    assert learner.observe(COMMON + "Wednesday") == PrefixObservation(30, False)
    assert learner.candidate == COMMON


def test_divergence_inside_a_word_cuts_back_before_that_word():
    learner = PrefixLearner()
    learner.observe("You are the planner agent alpha")
    # starts with the candidate, but "alpha" is cut inside "alphabet": back to the space
    assert learner.observe("You are the planner agent alphabet") == PrefixObservation(26, True)
    assert learner.candidate == "You are the planner agent "
    assert learner.observe("You are the planner agent alpine") == PrefixObservation(26, False)


def test_prompt_that_is_a_prefix_of_the_candidate_becomes_the_candidate():
    learner = PrefixLearner()
    learner.observe(PLANNER + " Tail.")
    assert learner.observe(PLANNER) == PrefixObservation(len(PLANNER), True)
    assert learner.candidate == PLANNER


def test_fixed_is_none_while_shorter_than_min_chars():
    learner = PrefixLearner(min_chars=16)
    learner.observe("Plan A now")
    assert learner.observe("Plan B now") == PrefixObservation(0, True)
    assert learner.candidate == "Plan "
    assert learner.fixed is None


def test_short_identical_prompts_are_never_fixed_below_min_chars():
    learner = PrefixLearner(min_chars=16)
    assert learner.observe("Hi there") == PrefixObservation(0, True)
    for _ in range(3):
        assert learner.observe("Hi there") == PrefixObservation(0, False)
    assert learner.hits == 4
    assert learner.fixed is None


def test_lower_min_chars_lets_a_short_prefix_be_fixed():
    learner = PrefixLearner(min_chars=4)
    learner.observe("Hi there")
    assert learner.observe("Hi there") == PrefixObservation(8, False)
    assert learner.fixed == "Hi there"


def test_explicit_delimiter_fixes_the_prefix_on_the_first_observation():
    learner = PrefixLearner(delimiters=("<<END>>",))
    prompt = "System rules for all agents<<END>> today: Monday"
    at = prompt.index("<<END>>")
    assert learner.observe(prompt) == PrefixObservation(at + 7, True)
    assert learner.candidate == "System rules for all agents<<END>>"
    assert learner.fixed == "System rules for all agents<<END>>"


def test_explicit_delimiter_repeated_reports_no_change():
    learner = PrefixLearner(delimiters=("<<END>>",))
    learner.observe("System rules for all agents<<END>> Monday")
    assert learner.observe("System rules for all agents<<END>> Tuesday") == PrefixObservation(34, False)


def test_delimiter_absent_falls_back_to_learning():
    learner = PrefixLearner(delimiters=("<<END>>",))
    assert learner.observe(MONDAY) == PrefixObservation(0, True)
    assert learner.observe(TUESDAY) == PrefixObservation(30, True)


def test_common_chars_is_zero_before_any_observation():
    assert PrefixLearner().common_chars(PLANNER) == 0


def test_common_chars_counts_the_shared_prefix_with_the_candidate():
    learner = PrefixLearner()
    learner.observe(MONDAY)
    assert learner.common_chars("You are the planner. Tomorrow") == 23
    assert learner.common_chars(MONDAY + " and more") == len(MONDAY)
    assert learner.common_chars("Something else") == 0


def test_fixed_prefix_never_ends_inside_a_word_of_the_prompt():
    learner = PrefixLearner()
    learner.observe("You are a helpful agent named Bob")
    prompt = "You are a helpful agent named Bobby"
    assert learner.observe(prompt).fixed_chars == len("You are a helpful agent named ")
    assert learner.fixed == "You are a helpful agent named "


def test_common_prefix_len_equals_a_character_walk_at_any_offsets():
    rng = random.Random(3)
    for _ in range(5000):
        a = "".join(rng.choice("ab ") for _ in range(rng.randrange(12)))
        b = "".join(rng.choice("ab ") for _ in range(rng.randrange(12)))
        i, j = rng.randrange(len(a) + 2), rng.randrange(len(b) + 2)
        walk = 0
        while i + walk < len(a) and j + walk < len(b) and a[i + walk] == b[j + walk]:
            walk += 1
        assert common_prefix_len(a, b, i, j) == walk, (a, b, i, j)


def test_an_endless_system_prompt_is_learned_in_linear_time():
    def learn(n: int):
        first, second = "x" * n + "1", "x" * n + "2"  # one endless word, differing at its end

        def run() -> None:
            learner = PrefixLearner()
            learner.observe(first)
            learner.observe(second)
        return run

    ratio = cpu_ratio(learn(500_000), learn(2_000_000))
    assert ratio < LINEAR_RATIO_BOUND, f"4x the prompt took {ratio:.1f}x the time"
