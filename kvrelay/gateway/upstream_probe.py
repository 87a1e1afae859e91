"""UpstreamProber: fidelity-guard scores for upstreams that do not score probes themselves.

The embedded engine scores a probed (approximate) request again densely on its idle time
and reports it (engine_ext/probes.py, kvrelay/gateway/fidelity_poll.py). vLLM has no such
endpoint, so for an upstream the poller found without one the gateway scores the probe
itself, through vLLM's own API, one probe at a time and only while that upstream has none
of this gateway's requests in flight:

1. the prompt without its plan, greedy, `num_tokens` tokens, asking for the prompt's and
   the answer's token ids (vLLM's `return_token_ids`): the dense answer;
2. prompt and dense answer as token ids to /v1/completions, one token, `prompt_logprobs`
   `top_k`, without the plan: the dense next-token lists at the answer's positions
   (vLLM's prefix cache serves the prompt);
3. the same with the plan (its probe flag off): the approximate lists.

top-1 agreement is the share of answer positions where the approximate first choice is
the dense token; KL(dense || approximate) is estimated on the union of both top-k lists,
each renormalised (the tails beyond k are left out). The score goes to the guard exactly
as an engine's would.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import aiohttp

from kvrelay.gateway.fidelity_guard import FidelityGuard, Score
from kvrelay.gateway.upstreams import UpstreamPool
from kvrelay.wire.plan import PLAN_KEY
from kvrelay.wire.salt import SALT_FIELD
from kvrelay.wire.seal import SEAL_KEY, PlanSeal

logger = logging.getLogger(__name__)

MAX_QUEUED = 64  # probes waiting for an idle upstream; older ones are dropped first
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")  # the Responses API is left to engines that score


class Probe(NamedTuple):
    url: str  # the upstream that answered
    endpoint: str
    body: dict[str, Any]  # as sent upstream, plan included
    tenant: str
    app: str
    method: str


class ProbeFailed(Exception):
    """The upstream did not answer a scoring request as vLLM does."""


class UpstreamProber:
    def __init__(self, http: aiohttp.ClientSession, pool: UpstreamPool, guard: FidelityGuard,
                 scores_itself: Callable[[str], bool | None], seal: PlanSeal | None = None, num_tokens: int = 16,
                 top_k: int = 5, interval_s: float = 0.5, timeout_s: float = 120.0) -> None:
        self.http = http
        self.seal = seal  # the gateway's: a connector that checks seals follows only sealed plans
        self.pool = pool
        self.guard = guard
        self.scores_itself = scores_itself  # None: not known yet
        self.num_tokens = num_tokens
        self.top_k = top_k
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._queue: deque[Probe] = deque(maxlen=MAX_QUEUED)
        self.num_scored = 0
        self.num_failed = 0

    def offer(self, probe: Probe) -> bool:
        """Queue a probed request that an upstream without its own scoring answered."""
        if probe.endpoint not in ENDPOINTS or self.scores_itself(probe.url) is not False:
            return False
        self._queue.append(probe)
        return True

    async def run(self) -> None:
        """The loop a SupervisedTask runs."""
        while True:
            await self.step()
            await asyncio.sleep(self.interval_s)

    async def step(self) -> int:
        """Score the queued probes whose upstream is idle now; the number scored."""
        done = 0
        for probe in list(self._queue):
            upstream = next((u for u in self.pool.upstreams if u.url == probe.url), None)
            if upstream is None or upstream.in_flight > 0:
                continue  # gone, or busy: the probe waits for spare capacity
            self._queue.remove(probe)
            try:
                top1, kl, tokens = await self.score(probe)
            except (ProbeFailed, aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
                self.num_failed += 1
                logger.info("fidelity probe on %s could not be scored: %s", probe.url, exc)
                continue
            self.guard.record(Score(probe.tenant, probe.app, probe.method, top1, kl, tokens))
            self.num_scored += 1
            done += 1
        return done

    async def score(self, probe: Probe) -> tuple[float, float, int]:
        """(top-1 agreement, KL, answer tokens) of one probe."""
        plan = (probe.body.get("kv_transfer_params") or {})[PLAN_KEY]
        dense_body = _without_plan(probe.body)
        dense_body.update(stream=False, temperature=0, max_tokens=self.num_tokens, n=1, return_token_ids=True)
        for key in ("stream_options", "max_completion_tokens", "logprobs", "top_logprobs"):
            dense_body.pop(key, None)
        answer = await self._post(probe.url + probe.endpoint, dense_body)
        prompt_ids = answer.get("prompt_token_ids") or answer["choices"][0].get("prompt_token_ids")
        answer_ids = answer["choices"][0]["token_ids"]
        if not prompt_ids or not answer_ids:
            raise ProbeFailed("no token ids in the dense answer (not vLLM?)")
        scoring = {"model": probe.body.get("model"), "prompt": list(prompt_ids) + list(answer_ids), "max_tokens": 1,
                   "temperature": 0, "prompt_logprobs": self.top_k}
        if SALT_FIELD in probe.body:  # the tenant's: its text stays in its cache, its placements are found
            scoring[SALT_FIELD] = probe.body[SALT_FIELD]
        dense = _positions(await self._post(probe.url + "/v1/completions", scoring), len(prompt_ids))
        approx_plan = {**plan, "probe": False}
        params: dict[str, Any] = {PLAN_KEY: approx_plan}
        if self.seal is not None:
            params[SEAL_KEY] = self.seal.seal(approx_plan)
        approx = _positions(await self._post(probe.url + "/v1/completions", {**scoring, "kv_transfer_params": params}),
                            len(prompt_ids))
        if len(dense) != len(answer_ids) or len(approx) != len(answer_ids):
            raise ProbeFailed("prompt_logprobs do not cover the answer")
        top1 = sum(_first(a) == token for a, token in zip(approx, answer_ids, strict=True)) / len(answer_ids)
        kl = sum(_kl(d, a) for d, a in zip(dense, approx, strict=True)) / len(answer_ids)
        return top1, kl, len(answer_ids)

    async def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as response:
            if response.status != 200:
                raise ProbeFailed(f"{url} answered HTTP {response.status}")
            data = await response.json(content_type=None)
        if not isinstance(data, dict):
            raise ProbeFailed(f"{url} answered with no JSON object")
        return data


def _without_plan(body: dict[str, Any]) -> dict[str, Any]:
    params = {k: v for k, v in (body.get("kv_transfer_params") or {}).items() if k not in (PLAN_KEY, SEAL_KEY)}
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params:
        out["kv_transfer_params"] = params
    return out


def _positions(answer: dict[str, Any], num_prompt: int) -> list[dict[int, float]]:
    """vLLM's prompt_logprobs past the prompt: per position, token id -> logprob."""
    lists = answer["choices"][0].get("prompt_logprobs") or answer.get("prompt_logprobs")
    if not isinstance(lists, list):
        raise ProbeFailed("no prompt_logprobs in the answer (not vLLM?)")
    return [{int(token): float(entry["logprob"]) for token, entry in (p or {}).items()} for p in lists[num_prompt:]]


def _first(position: dict[int, float]) -> int:
    return max(position, key=position.__getitem__)


def _kl(dense: dict[int, float], approx: dict[int, float]) -> float:
    """KL(dense || approx) over the union of both lists, renormalised; a token one side
    did not list gets that side's smallest listed probability."""
    tokens = dense.keys() | approx.keys()
    p = {t: math.exp(dense.get(t, min(dense.values()))) for t in tokens}
    q = {t: math.exp(approx.get(t, min(approx.values()))) for t in tokens}
    sp, sq = sum(p.values()), sum(q.values())
    return max(0.0, sum(p[t] / sp * math.log((p[t] / sp) / (q[t] / sq)) for t in tokens))
