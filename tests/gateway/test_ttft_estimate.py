"""The TTFT saving is honest: the TTFT the engine estimates prefix caching alone would
have given each request is checked against a measured replay of the same requests on an
engine with reuse off (prefix caching only), from the same cache state.

The reuse-on side is a multi-agent debate through the gateway to an embedded SmolLM2
engine with an approximate method (blend; the engine's default is exact, which places
nothing and saves 0): three agents read a shared brief, then each reads the others'
answers. Its estimates are what GET /admin/sessions/{id}/ttft reports. The replay sends
the very token ids the engine received, in the same order, to a second server whose
engine has reuse off; both servers first get the same warm-up of dense prompts (the
prefill-time fit learns from them, and both caches hold them). Requests run one at a
time, so TTFT is the engine's own work, not other requests' load; each is replayed as
soon as it is answered, so a machine shared with other work slows both sides alike.

What is compared, summed over the debate's requests: the estimate, `dense_ttft_s` -
`prepare_s`, against the replay's measured `ttft_s` - `prepare_s` (prepare is the
server's tokenizing, which differs: chat rendering and plan alignment against token ids
sent as such). They must agree within 25%.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from engine_ext.config import EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.request import EngineRequest
from kvrelay.gateway.settings import Timeouts

pytestmark = pytest.mark.slow

MODEL = "smollm2"
SESSION = "debate"
KV_BYTES = 256 * 2**20
BRIEF = (
    "Harbour council brief. The town of Saltmere runs a small harbour with three piers. The north pier handles "
    "fishing boats, which land about forty tonnes of cod and haddock each week in winter and half that in summer. "
    "The middle pier serves the ferry to the islands, six crossings a day in summer and two in winter, carrying "
    "around nine hundred passengers a week. The south pier is old timber; engineers rated it unsafe for lorries "
    "last spring and it now takes only pleasure boats. Repairing the south pier would cost about two million "
    "pounds and take eighteen months; demolishing it would cost four hundred thousand. A wind-farm company offers "
    "to lease the south pier for service vessels for twenty years at one hundred and fifty thousand a year, if the "
    "town repairs it first. The fishing cooperative wants the money spent on a new ice plant for the north pier "
    "instead, which would cost six hundred thousand. The ferry operator warns that winter storms damaged its "
    "ramp and that repairs cannot wait beyond next year. The council has one point eight million pounds in "
    "reserves and may borrow at five percent."
)
QUESTION = "Question: what should the council do with the south pier, and why?"
AGENTS = ("You are the treasurer of the council. Answer in two sentences.",
          "You are the harbour master, who knows every boat and tide in Saltmere. Answer in two sentences.",
          "You are a councillor who represents the fishing families of the north end of town. Answer in two "
          "sentences.")
TOLERANCE = 0.25
ADMIN = "admin-" + "s3cret" * 4


def _warm_up_prompts() -> list[list[int]]:
    """Dense prompts of many lengths, some extending an earlier one (a prefix hit), so
    the prefill-time fit has seen prefills like the debate's before pricing them."""
    rng = random.Random(7)
    fresh = [[rng.randrange(100, 40000) for _ in range(n)] for n in (40, 80, 160, 320, 640, 1000)]
    extended = [fresh[3] + [rng.randrange(100, 40000) for _ in range(64)],
                fresh[4] + [rng.randrange(100, 40000) for _ in range(200)]]
    return fresh + extended


def _complete(base_url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One text completion of token ids, greedy, with the engine's TTFT breakdown."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{base_url}/v1/completions", json=body, headers={"x-kvrelay-ttft": "1"}, timeout=300)
    reply.raise_for_status()
    return reply.json()["kv_transfer_params"]["kvrelay_ttft"]


def _debate(client: openai.OpenAI, replay: Callable[[int], None]) -> None:
    """Round 1: each agent reads the brief and answers; round 2: each also reads the
    others' answers. One request at a time, each replayed (given its max_tokens) once answered."""
    ask = f"{BRIEF}\n\n{QUESTION}"
    answers: list[str] = []
    for round_ in range(2):
        said = list(answers)
        for k, system in enumerate(AGENTS):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": ask}]
            messages += [{"role": "user", "name": f"agent{j}", "content": text} for j, text in enumerate(said) if j != k]
            limit = 48 if round_ == 0 else 16
            reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=limit, messages=messages,
                                                   extra_headers={"x-kvrelay-session-id": SESSION})
            replay(limit)
            if round_ == 0:
                answers.append(reply.choices[0].message.content)


def test_the_prefix_caching_estimate_matches_a_measured_replay_with_reuse_off(smollm2_dir, run_server,
                                                                               start_gateway):
    reuse_on = LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=KV_BYTES, reuse=ReuseConfig(default_method="blend")),
                         model_name=MODEL)
    received: list[list[int]] = []  # every prompt's token ids as the engine got them, in order
    add_request = reuse_on.add_request
    lock = threading.Lock()

    def recording(request: EngineRequest, *args: Any, **kwargs: Any) -> Any:
        with lock:
            received.append(list(request.prompt_token_ids))
        return add_request(request, *args, **kwargs)

    reuse_on.add_request = recording  # type: ignore[method-assign]
    reuse_off = LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=KV_BYTES, reuse=ReuseConfig(enabled=False)),
                          model_name=MODEL)
    warm_up = _warm_up_prompts()
    measured: list[dict[str, Any]] = []
    with run_server(reuse_on, MODEL) as on, run_server(reuse_off, MODEL) as off:
        for prompt in warm_up:
            _complete(on.base_url, prompt, 1)
            _complete(off.base_url, prompt, 1)
        gw = start_gateway([on.base_url], admin_key=ADMIN, timeouts=Timeouts())  # seconds per request on a CPU
        with openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=300) as client:
            _debate(client, lambda limit: measured.append(_complete(off.base_url, received[-1], limit)))
        gw.rows(2 * len(AGENTS), timeout=30)  # written by the gateway's writer, a moment later
        with gw.client(headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
            report = admin.get(f"/admin/sessions/{SESSION}/ttft").json()
    assert "requests" in report, report
    debate = received[len(warm_up):]
    estimates = [r["engine"] for r in report["requests"]]
    assert len(debate) == len(estimates) == len(measured) == 2 * len(AGENTS)
    assert sum(e["reused_tokens"] for e in estimates) > 200  # blend placed the brief and the answers
    assert all("dense_ttft_s" in e for e in estimates), estimates  # the warm-up taught the rate: all priced

    estimate_s = sum(e["dense_ttft_s"] - e["prepare_s"] for e in estimates)
    replay_s = sum(m["ttft_s"] - m["prepare_s"] for m in measured)
    lines = [f"{'request':>7} {'prompt':>6} {'hit':>5} {'reused':>6} {'actual ms':>9} {'estimate ms':>11} "
             f"{'replay ms':>9} {'replay hit':>10}"]
    for i, (e, m, prompt) in enumerate(zip(estimates, measured, debate)):
        lines.append(f"{i:>7} {len(prompt):>6} {e['prefix_hit_tokens']:>5.0f} {e['reused_tokens']:>6.0f} "
                     f"{(e['ttft_s'] - e['prepare_s']) * 1e3:>9.0f} {(e['dense_ttft_s'] - e['prepare_s']) * 1e3:>11.0f} "
                     f"{(m['ttft_s'] - m['prepare_s']) * 1e3:>9.0f} {m['prefix_hit_tokens']:>10.0f}")
    lines.append(f"total estimate {estimate_s * 1e3:.0f} ms, replay {replay_s * 1e3:.0f} ms, "
                 f"ratio {estimate_s / replay_s:.3f}; saved {report['totals']['saved_s'] * 1e3:.0f} ms")
    print("\n".join(lines))  # shown with -s: the figures per request
    # The replay computed what the baseline says prefix caching alone would have served.
    assert [m["prefix_hit_tokens"] for m in measured] == [e["prefix_hit_tokens"] for e in estimates]
    assert abs(estimate_s - replay_s) <= TOLERANCE * replay_s, "\n".join(lines)
