"""One request must never take the gateway down: text that cannot be encoded, integers no
engine can hold, NUL in every field. Each gets a 400 naming its field (or is served),
each is recorded once, and afterwards the writer still writes, /metrics and /ready
answer, and a normal request works.

Bodies go as raw JSON so a lone surrogate travels as the `\\ud800` escape a client sends."""

from __future__ import annotations

import json

import pytest

from tests.gateway.support import read_rows, wait_until

LONE = "\ud800"
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}]}
TEXT = {"model": "fake", "prompt": "Hi"}


def chat(**changes) -> dict:
    return {**CHAT, **changes}


def user(**fields) -> dict:
    return chat(messages=[{"role": "user", "content": "Hi", **fields}])


# (endpoint, body, the field the error names)
REFUSED = [
    ("/v1/chat/completions", chat(model="fake" + LONE), "model"),
    ("/v1/chat/completions", chat(messages=[{"role": "system", "content": LONE}, {"role": "user", "content": "Hi"}]),
     "messages[0].content"),
    ("/v1/chat/completions", user(content=LONE), "messages[0].content"),
    ("/v1/chat/completions", user(content=[{"type": "text", "text": "a" + LONE}]), "messages[0].content[0].text"),
    ("/v1/chat/completions", user(name="n" + LONE), "messages[0].name"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "Hi"},
                                            {"role": "tool", "content": LONE, "tool_call_id": "c"}]),
     "messages[1].content"),
    ("/v1/chat/completions", chat(metadata={"k" + LONE: 1}), "metadata.<key>"),
    ("/v1/chat/completions", chat(user=LONE), "user"),
    ("/v1/chat/completions", chat(seed=2**70), "seed"),
    ("/v1/chat/completions", chat(max_tokens=-(2**64)), "max_tokens"),
    ("/v1/chat/completions", chat(logit_bias={"5": 2**80}), "logit_bias.5"),
    ("/v1/completions", {**TEXT, "prompt": "Hi" + LONE}, "prompt"),
    ("/v1/completions", {**TEXT, "prompt": [1, 2, 2**64]}, "prompt[2]"),
    ("/v1/completions", {**TEXT, "kv_transfer_params": {"note": float("nan")}}, "kv_transfer_params.note"),
    ("/v1/chat/completions", chat(x_unknown=float("-inf")), "x_unknown"),
]

# Valid Unicode that databases, labels and logs must take as it is (a model no upstream
# serves is a 404, recorded all the same).
SERVED = [
    ("/v1/chat/completions", chat(model="fake\x00"), 404),
    ("/v1/chat/completions", user(content="a\x00b \u202e bidi \u0000"), 200),
    ("/v1/chat/completions", chat(user="session\x00id"), 200),
    ("/v1/completions", {**TEXT, "prompt": "nul\x00 in a prompt"}, 200),
]


def post(http, endpoint: str, body: dict):
    return http.post(endpoint, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.fixture
def gateway(fake_upstream, start_gateway):
    fake = fake_upstream(models=["fake"])
    gw = start_gateway([fake.url], store_content=True)
    return fake, gw


def test_each_poison_request_is_refused_naming_its_field_and_recorded(gateway):
    fake, gw = gateway
    with gw.client() as http:
        for endpoint, body, field in REFUSED:
            r = post(http, endpoint, body)
            assert r.status_code == 400, (field, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == field, error
            assert error["message"].startswith(f"{field}: ")
            assert post(http, "/v1/chat/completions", CHAT).status_code == 200
        assert len(fake.received) == len(REFUSED)  # only the normal requests went upstream
        assert http.get("/metrics").status_code == 200
        assert http.get("/ready").status_code == 200
    rows = gw.rows(2 * len(REFUSED))
    assert len(rows) == 2 * len(REFUSED)
    refused = [row for row in rows if row.status == "client_error"]
    assert len(refused) == len(REFUSED) and all(row.http_status == 400 for row in refused)


def test_nul_and_other_valid_unicode_is_served_recorded_and_labelled_safely(gateway):
    _, gw = gateway
    with gw.client() as http:
        for endpoint, body, status in SERVED:
            assert post(http, endpoint, body).status_code == status
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        assert http.get("/ready").status_code == 200
    rows = gw.rows(len(SERVED))
    assert sorted(row.http_status for row in rows) == sorted(status for *_, status in SERVED)
    assert all("\x00" not in (row.prompt_text or "") + (row.model or "") + (row.session_id or "") for row in rows)
    # The client's model string "fake\x00" is served by no upstream: its label is "other".
    assert 'model="other"' in metrics.text and "\x00" not in metrics.text
    assert gw.state.writer.num_quarantined == 0


def test_a_model_label_is_a_served_model_or_other(gateway):
    _, gw = gateway
    with gw.client() as http:
        for i in range(20):
            post(http, "/v1/chat/completions", chat(model=f"made-up-{i}"))
        post(http, "/v1/chat/completions", CHAT)
        text = http.get("/metrics").text
    labels = {line.split('model="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("kvrelay_request_duration_seconds_count")}
    assert labels == {"fake", "other"}


def test_the_record_writer_is_supervised(gateway):
    """A record writer task that ends (a bug) is restarted with the batch it held; /ready
    says it is down meanwhile; no record is lost."""
    _, gw = gateway
    writer = gw.state.writer
    with gw.client() as http:
        assert post(http, "/v1/chat/completions", CHAT).status_code == 200
        assert wait_until(lambda: writer.num_written == 1, 5)
        writer._runner._task.get_loop().call_soon_threadsafe(writer._runner._task.cancel)  # the task ends, not by close()
        assert wait_until(lambda: not writer.alive, 5)
        ready = http.get("/ready")
        assert ready.status_code == 503 and "record writer" in ready.json()["error"]["message"]
        assert post(http, "/v1/chat/completions", CHAT).status_code == 200
        assert wait_until(lambda: writer.alive, 5)
        assert http.get("/ready").status_code == 200
        assert 'kvrelay_record_writer_restarts_total 1.0' in http.get("/metrics").text
    assert len(gw.rows(2)) == 2
    assert len(read_rows(gw.db_path)) == 2


def test_ready_names_a_background_loop_that_is_down(gateway):
    _, gw = gateway
    health = next(loop for loop in gw.app.state.loops if loop.name == "kvrelay-health")
    with gw.client() as http:
        assert http.get("/ready").status_code == 200
        health._task.get_loop().call_soon_threadsafe(health._task.cancel)
        assert wait_until(lambda: not health.alive, 5)
        ready = http.get("/ready")
        assert ready.status_code == 503 and "kvrelay-health" in ready.json()["error"]["message"]
        assert wait_until(lambda: health.alive, 5)
        assert http.get("/ready").status_code == 200
