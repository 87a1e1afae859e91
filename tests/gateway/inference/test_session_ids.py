"""New session ids: random on one gateway; for replicas, the same from the same ask, the
same last start and the same minute, and another when any of them differs."""

from __future__ import annotations

from kvrelay.gateway.inference.messages import PromptMessage
from kvrelay.gateway.inference.session_ids import WINDOW_S, SessionStarts, ask_of, new_session_id

NOW = 1_800_000_000.0


def _ask(system: str, user: str) -> str:
    return ask_of([PromptMessage(0, "system", None, system), PromptMessage(1, "user", None, user)])


def test_agents_with_their_own_personas_asking_one_question_make_one_ask():
    assert _ask("You are the chair.", "Should the mill close?") == _ask("You are the critic.", "Should the mill close?")
    assert _ask("You are the chair.", "Should the mill close?") != _ask("You are the chair.", "Should it open?")


def test_agreed_ids_depend_on_the_app_the_ask_the_last_start_and_the_minute():
    starts, ask = SessionStarts(), _ask("s", "q")
    first = new_session_id(True, "app", ask, starts, NOW)
    assert first == new_session_id(True, "app", ask, SessionStarts(), NOW + 1)  # another replica, same minute
    assert first != new_session_id(True, "other-app", ask, starts, NOW)
    assert first != new_session_id(True, "app", _ask("s", "q2"), starts, NOW)
    assert first != new_session_id(True, "app", ask, starts, NOW + WINDOW_S)  # after a restart, a minute on
    starts.started(ask, first)
    second = new_session_id(True, "app", ask, starts, NOW)  # the task run again
    assert second not in (first, new_session_id(True, "app", ask, SessionStarts(), NOW))
    assert first.startswith("sess-") and len(first) == len("sess-") + 16


def test_one_gateway_mints_random_ids_and_starts_are_bounded():
    starts = SessionStarts(max_asks=2)
    assert new_session_id(False, "app", "a", starts, NOW) != new_session_id(False, "app", "a", starts, NOW)
    for n in range(3):
        starts.started(f"ask-{n}", f"sess-{n}")
    assert starts.last("ask-0") is None and starts.last("ask-2") == "sess-2"


def test_the_ask_is_hashed_only_when_a_session_starts(monkeypatch):
    import kvrelay.gateway.inference.planner as planner
    from kvrelay.gateway.adapters import AdapterRouter
    from kvrelay.gateway.identity import Identity
    from kvrelay.gateway.inference import Inference
    from kvrelay.gateway.settings import GatewaySettings

    hashed: list[int] = []
    monkeypatch.setattr(planner, "ask_of", lambda messages: hashed.append(len(messages)) or ask_of(messages))
    settings = GatewaySettings()
    inference = Inference(settings.inference, AdapterRouter.from_settings(settings.adapters))
    inference.agreed_session_ids = True
    answer = "The mill should stay open through the winter, since the orders for spring are already booked."
    first = inference.plan(Identity("app", None, None), {"messages": [
        {"role": "system", "content": "You are the chair."}, {"role": "user", "content": "Should the mill close?"}]},
        "req-1", "m")
    inference.observe_response("app", first.session_id, first.agent_id, "req-1", answer, ())
    assert hashed == [2]  # a session started: its id derives from the ask
    quoting = inference.plan(Identity("app", None, None), {"messages": [
        {"role": "system", "content": "You are the critic."},
        {"role": "user", "content": f"The chair said: {answer} Do you agree?"}]}, "req-2", "m")
    assert quoting.session_id == first.session_id and hashed == [2]  # linked to it: nothing to hash
    inference.plan(Identity("app", "given", None), {"messages": [{"role": "user", "content": "Hi"}]}, "req-3", "m")
    assert hashed == [2]  # the client named the session
