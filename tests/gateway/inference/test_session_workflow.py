"""The plan's workflow is per session (KVFlow per workflow instance): with several sessions
of one app interleaved, each plan's steps-to-execution start from that session's own
requesting agent, and its next agent is the one after it in that session."""

from __future__ import annotations

from kvrelay.gateway.identity import identify
from kvrelay.gateway.inference import Inference
from kvrelay.gateway.settings import InferenceSettings

NUM_AGENTS = 6
SYSTEMS = [f"You are agent {i} of the pipeline. Do your part of the job and pass it on. " * 3
           for i in range(NUM_AGENTS)]


def test_interleaved_sessions_each_get_their_own_position_in_the_step_graph():
    inference = Inference(InferenceSettings())
    position = [0, 2, 4]  # three sessions of one ring, out of phase
    previous = ["", "", ""]
    for round_index in range(8):
        for s in range(len(position)):
            agent = position[s] % NUM_AGENTS
            body = {"messages": [{"role": "system", "content": SYSTEMS[agent]},
                                 {"role": "user", "content": f"Task {s}. Previous: {previous[s]}"}]}
            ident = identify({"x-session-id": f"sess{s}", "x-agent-id": f"agent{agent}"}, body, None)
            plan = inference.plan(ident, body, f"r{round_index}-{s}", "m").plan
            previous[s] = f"output of agent {agent} in session {s}, round {round_index}"
            inference.observe_response("default", f"sess{s}", f"agent{agent}", plan.request_id, previous[s])
            position[s] += 1
            if round_index < 2:  # every edge of the ring is learned once each agent has run
                continue
            assert plan.session_id == f"sess{s}" and plan.workflow is not None
            steps = plan.workflow.steps_to_execution
            assert steps[f"agent{agent}"] == 0
            assert steps[f"agent{(agent + 1) % NUM_AGENTS}"] == 1
            assert plan.workflow.next == [f"agent{(agent + 1) % NUM_AGENTS}"]
