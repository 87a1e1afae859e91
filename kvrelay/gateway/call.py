"""One client request through the gateway, from body to record.

Reads top to bottom as the request path: read and check the body, identify the caller,
dispatch upstream (with failover), relay the answer (SSE byte for byte), record it once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from opentelemetry.trace import Tracer

from kvrelay.gateway.approximation import Approximation, HeaderChoice, parse_header
from kvrelay.gateway.fidelity_guard import FidelityGuard
from kvrelay.gateway.upstream_probe import Probe, UpstreamProber
from kvrelay.gateway.auth import AccessControl, Charge
from kvrelay.gateway.errors import (BadRequestError, BodyTooLargeError, GatewayError, GatewayInternalError, UpstreamFailedError,
                            UpstreamTimeoutError)
from kvrelay.gateway.identity import Identity, identify
from kvrelay.gateway.inference import Inference, RoundHold, StateStore
from kvrelay.gateway.metrics import GatewayMetrics
from kvrelay.gateway.settings import GatewaySettings
from kvrelay.gateway.endpoints import Endpoint, ResponseSessions
from kvrelay.gateway.event_stream import EventStreamResponse
from kvrelay.gateway.sse import EventReader, EventTooLargeError, is_done
from kvrelay.gateway.sse_deltas import DeltaReader
from kvrelay.gateway.storage.writer import RecordWriter, RequestRecord, sha256_text
from kvrelay.gateway.tracing import describe_plan, describe_request, end_call_span, start_call_span, trace_headers
from kvrelay.gateway.replicas import Replicas
from kvrelay.gateway.request_headers import RequestHeaders
from kvrelay.gateway.routing.policies import Route
from kvrelay.gateway.upstream_client import Dispatch, UpstreamClient
from kvrelay.wire.salt import SALT_FIELD, TenantSalts, check_salt
from kvrelay.wire.seal import PlanSeal
from kvrelay.wire.plan import RoundInfo, Segment, plan_text
from kvrelay.wire.cache_report import BLOCKS_HEADER, read_prompt_blocks
from kvrelay.wire.reports import TTFT_HEADER, TTFT_KEY, TtftBreakdown, wants_breakdown
from kvrelay.gateway.engine_params import (event_without_params, hidden_from_client, with_plan, without_client_plan,
                                   without_params)
from kvrelay.wire.errors import error_response
from kvrelay import json_codec
from kvrelay.json_values import body_misfit

logger = logging.getLogger(__name__)
REUSE_HEADER = "x-kvrelay-reuse"
REQUEST_ID_HEADER = "x-kvrelay-request-id"
_FORWARDED_HEADERS = ("content-type", "accept", "traceparent", "tracestate", "x-request-id")
_EMPTY_SHA256 = sha256_text("")


@dataclass
class GatewayState:
    settings: GatewaySettings
    upstreams: UpstreamClient
    writer: RecordWriter
    metrics: GatewayMetrics
    tracer: Tracer
    access: AccessControl
    inference: Inference
    store: StateStore | None = None  # None: inferred state is not persisted
    round_hold: RoundHold | None = None  # None: requests of a round are never held
    plan_seal: PlanSeal | None = None  # None: plans go unsealed (an engine on loopback)
    approximation: Approximation = field(default_factory=Approximation)  # exact unless opted in
    fidelity: FidelityGuard | None = None  # None: the fidelity guard is off
    prober: UpstreamProber | None = None  # scores probes for upstreams that do not (vLLM); None: guard off
    responses: ResponseSessions = field(default_factory=ResponseSessions)  # previous_response_id -> session
    salts: TenantSalts = field(default_factory=lambda: TenantSalts(None))  # each tenant's cache_salt
    replicas: Replicas | None = None  # None: one gateway, nothing shared


class ProxiedCall:
    def __init__(self, state: GatewayState, endpoint: Endpoint, request: Request) -> None:
        self.state = state
        self.endpoint = endpoint  # how the route's bodies and answers read
        self.request = request
        self.view: dict[str, Any] = {}  # the body as planning reads it: chat-shaped for /v1/responses
        self.received = time.perf_counter()
        self.started_at = datetime.now(UTC)
        self.record = RequestRecord(
            id=f"req-{os.urandom(16).hex()}", endpoint=endpoint.path, stream=False, started_at=self.started_at,
            finished_at=self.started_at, latency_ms=0.0, status="ok", http_status=200,
            prompt_sha256=_EMPTY_SHA256, prompt_chars=0,
        )
        self.headers = RequestHeaders(request.headers.raw)
        self.strip_usage = False
        # What the engine echoes in kv_transfer_params that the client must not see: the
        # plan and seal, and the TTFT breakdown (asked for on every call, for the record)
        # unless the client asked too.
        self.hidden = hidden_from_client(wants_breakdown(self.headers))
        self._completion: list[str] = []
        self._tool_call_ids: list[str] = []  # of the answer: later prompts that carry them continue its session
        self._finish_reasons: list[str] = []
        self._response_id: str | None = None  # a Responses answer's id: continuations join its session
        self._shared = False  # the answer went to the other replicas (before the client had all of it)
        self._last_sequence = -1  # of a Responses stream's events: the gateway's own error event follows it
        self._charge: Charge | None = None
        self._app_id: str | None = None
        self._round: RoundInfo | None = None
        # Keep the request on its round's replica past the load guard: only when it places
        # other agents' KV (an approximate method), which its round shares only there. An
        # exact round's members share nothing but prefix hits, which routing weighs anyway.
        self._holds_round = False
        self._probe: tuple[str, str, str] | None = None  # (tenant, app, method) of a probed request
        self._client_salt: str | None = None  # the client's cache_salt: mixed into its tenant's, never sent
        self._probe_body: dict[str, Any] | None = None  # its upstream body, plan included
        self._route: Route | None = None  # what the routing policy knows of the prompt
        self._segments: list[Segment] = []  # the plan's, as sent: what routing may weigh
        self.span = start_call_span(state.tracer, endpoint.operation, self.headers)

    # -- the path ---------------------------------------------------------------------------
    async def run(self) -> Response:
        """The response, carrying the record's id in REQUEST_ID_HEADER so a client can find
        its request in /admin, the SQL records and the traces."""
        response = await self._respond()
        response.raw_headers.append((REQUEST_ID_HEADER.encode(), self.record.id.encode()))  # no header wrapper
        return response

    async def _respond(self) -> Response:
        self.state.metrics.in_flight.inc()
        dispatch: Dispatch | None = None  # closed here unless the relay took it
        handed_to_relay = False  # once the relay owns the upstream response, it records the call
        try:
            key = self.state.access.authenticate(self.headers)
            self.record.api_key_id = key.id if key is not None else None
            body = self._parse(await self._read_body())
            self._charge = self.state.access.admit(key, self.view)
            ident = identify(self.headers, self.view, self.record.api_key_id)
            if ident.session_id is None and (previous := self.endpoint.continues(body)) is not None:
                ident = ident._replace(session_id=self.state.responses.session_of(ident.app_id, previous))
            if self.state.store is not None and ident.session_id is not None:
                await self.state.store.restore(ident.app_id, ident.session_id)  # no-op while it is in memory
            if self.state.replicas is not None:
                await self.state.replicas.catch_up()  # what the other replicas told before this request came
            body = self._infer(body, ident)
            self._route = self.state.upstreams.pool.route(self.view, body.get(SALT_FIELD), self._segments,
                                                          self.record.id)
            payload = self._prepare(body)
            self.state.metrics.overhead.observe(time.perf_counter() - self.received)
            if self._round is not None and self.state.round_hold is not None:
                await self.state.round_hold.wait(self._round)
            dispatch = await self.state.upstreams.dispatch(
                self.endpoint.path, payload, self._headers(), self.record.model or "", self.record.session_id,
                hold=self._holds_round, route=self._route)
            self.record.upstream = dispatch.upstream.url
            if dispatch.response.status >= 400:
                return await self._upstream_error(dispatch)
            if self.record.stream:
                response = EventStreamResponse(self._relay(dispatch), abandoned=partial(self._abandoned, dispatch))
                dispatch, handed_to_relay = None, True
                return response
            return await self._unary(dispatch)
        except GatewayError as exc:
            return self._fail(exc)
        except Exception:
            logger.exception("request %s failed inside the gateway", self.record.id)
            return self._fail(GatewayInternalError("the gateway failed to handle the request"))
        finally:
            if dispatch is not None:
                dispatch.close()
            if not handed_to_relay:
                self._finish()

    async def _read_body(self) -> bytes:
        limit = self.state.settings.max_body_bytes
        declared = self.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise BodyTooLargeError(f"request body exceeds {limit} bytes")
        chunks, size = [], 0
        async for chunk in self.request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLargeError(f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _parse(self, raw: bytes) -> dict[str, Any]:
        try:
            body = json_codec.loads(raw)
        except RecursionError as exc:  # JSON nested past Python's recursion limit
            raise BadRequestError("the request body is nested too deeply") from exc
        except ValueError as exc:
            raise BadRequestError("the request body is not valid JSON") from exc
        if not isinstance(body, dict):
            raise BadRequestError("the request body must be a JSON object")
        if (misfit := body_misfit(raw, body)) is not None:  # before anything hashes, logs or records it
            raise BadRequestError(misfit.message, param=misfit.path)
        body = without_client_plan(body)  # the engine follows only the gateway's plans
        try:
            self._client_salt = check_salt(body.get(SALT_FIELD))
        except ValueError as exc:
            raise BadRequestError(str(exc), param=SALT_FIELD) from exc
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequestError("model: a non-empty string is required", param="model")
        self.record.model = model[:256]
        self.view, prompt_text = self.endpoint.view(body, self.state.settings.limits)
        describe_request(self.span, self.endpoint.operation, self.view, self.record.model)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequestError("stream: must be a boolean", param="stream")
        self.record.stream = stream
        self.record.prompt_sha256, self.record.prompt_chars = sha256_text(prompt_text), len(prompt_text)
        if self.state.settings.store_content:
            self.record.prompt_text = prompt_text
        return body

    def _infer(self, body: dict[str, Any], ident: Identity) -> dict[str, Any]:
        """Session, agent and the SegmentPlan; the plan rides along unless reuse is off.
        The adapter the plan routes to is applied either way: routing is not reuse."""
        model = self.record.model or ""
        choice = self._reuse_choice()
        result = self.state.inference.plan(ident, self.view, self.record.id, model)
        if self.state.replicas is not None:
            self.state.replicas.planned(ident, self.view, self.record.id, model, result.session_id)
        self._app_id, self._round = ident.app_id, result.plan.round
        self.record.session_id, self.record.agent_id = result.session_id, result.agent_id
        values = result.plan.model_dump(mode="json")  # serialized once, for the record and the upstream
        self.record.plan = plan_text(values)
        describe_plan(self.span, result.plan, result.session_inferred, result.agent_name)
        adapter = result.plan.adapter
        if adapter is not None and adapter.model != model:
            body = {**body, "model": adapter.model}
            self.record.model = adapter.model[:256]  # what ran, and what dispatch picks an upstream for
        plan = result.plan
        if not self.state.settings.inference.reuse or choice == "off":
            # No reuse: no segments, no round, no workflow; the plan still names the
            # tenant, whose prefix cache alone the request may read and fill.
            plan = plan.model_copy(update={"segments": [], "round": None, "workflow": None})
            values = plan.model_dump(mode="json")
        else:
            approx, tenant = self.state.approximation, plan.tenant or ident.app_id
            method = approx.method_for(choice, tenant, ident.app_id, plan.agent_id, self.record.model or "")
            if method is not None:  # a sampled share is scored again by the engine (kvrelay/gateway/fidelity_guard.py)
                plan = Approximation.apply(plan, method, approx.wants_probe(tenant, ident.app_id, method))
                self._holds_round = plan.round is not None
                values = plan.model_dump(mode="json")
                self.record.plan = plan_text(values)  # the record says which method ran
                if plan.probe:
                    self._probe = (tenant, ident.app_id, method)
        self._segments = plan.segments
        body = with_plan(body, values, self.state.plan_seal)
        # The tenant's salt replaces the client's: engines share cached KV within it only.
        namespace = plan.tenant or self.state.inference.tenants.namespace(ident.app_id)
        body = {**body, SALT_FIELD: self.state.salts.salt(namespace, self._client_salt)}
        if self._probe is not None:
            self._probe_body = body
        return body

    def _reuse_choice(self) -> HeaderChoice:
        """The client's X-Kvrelay-Reuse, checked before any planning."""
        try:
            return parse_header(self.headers.get(REUSE_HEADER))
        except ValueError as exc:
            raise BadRequestError(f"{REUSE_HEADER} {exc}", param=REUSE_HEADER) from exc

    def _prepare(self, body: dict[str, Any]) -> bytes:
        """The upstream body, its stream's usage asked for (Endpoint.upstream_body)."""
        body, self.strip_usage = self.endpoint.upstream_body(body, self.record.stream)
        return json_codec.dumps(body)

    def _headers(self) -> dict[str, str]:
        """Content headers, and the trace context: the client's, continued by our span."""
        headers = {k: v for k in _FORWARDED_HEADERS if (v := self.headers.get(k))}
        headers.update(trace_headers(self.span))
        headers[TTFT_HEADER] = "1"  # the engine's TTFT breakdown, reuse on or off (other upstreams ignore it)
        if self.state.upstreams.pool.policy.reads_cache:
            headers[BLOCKS_HEADER] = "1"  # the prompt's blocks, for cache-aware routing
        if (upstream_key := self.state.settings.upstream_api_key) is not None:
            headers["authorization"] = f"Bearer {upstream_key.get_secret_value()}"
        return headers

    # -- answers ----------------------------------------------------------------------------
    async def _unary(self, dispatch: Dispatch) -> Response:
        content = await dispatch.response.read()
        self._observe_upstream(dispatch)
        try:
            parsed = json.loads(content)
        except (ValueError, RecursionError) as exc:
            raise UpstreamFailedError("the upstream answered with invalid JSON") from exc
        if isinstance(parsed, dict):
            facts = self.endpoint.answer(parsed)
            self._response_id = facts.response_id
            self._take_usage(facts.usage)
            self._completion.append(facts.text)
            self._tool_call_ids += facts.call_ids
            self._finish_reasons.extend(facts.finish_reasons)
            params = parsed.get("kv_transfer_params")
            self._take_engine_reports(params)
            if isinstance(params, dict) and any(key in params for key in self.hidden):
                content = json.dumps(without_params(parsed, self.hidden), separators=(",", ":")).encode()
        await self._share_answer()
        return Response(content, status_code=dispatch.response.status, media_type="application/json")

    async def _share_answer(self) -> None:
        """With replicas: the answer goes to the shared log before its end goes to the
        client (waiting at most `replication.barrier_ms` for the commit), so a prompt that
        quotes it is planned with it whichever replica gets it."""
        replicas, rec = self.state.replicas, self.record
        if (replicas is None or self._shared or rec.status != "ok" or self._app_id is None or not rec.session_id
                or not rec.agent_id):
            return
        self._shared = True
        await replicas.share_answer(self._app_id, rec.session_id, rec.agent_id, rec.id, "".join(self._completion),
                                    tuple(dict.fromkeys(self._tool_call_ids)), self._response_id)

    async def _upstream_error(self, dispatch: Dispatch) -> Response:
        content = await dispatch.response.read()
        status = dispatch.response.status
        if status < 500:  # the client's mistake, in the engine's own OpenAI error body
            self.record.status, self.record.http_status, self.record.error_type = "client_error", status, "upstream_4xx"
            return Response(content, status_code=status, media_type="application/json")
        try:
            message = json.loads(content)["error"]["message"]
        except (ValueError, KeyError, TypeError, RecursionError):
            message = content[:200].decode(errors="replace")
        raise UpstreamFailedError(f"upstream {dispatch.upstream.url} returned {status}: {message}")

    async def _relay(self, dispatch: Dispatch) -> AsyncIterator[bytes]:
        """Forward SSE events as they arrive; note TTFT and usage on the way."""
        reader, deltas = EventReader(), DeltaReader()
        deadline = self.received + self.state.settings.timeouts.total_s
        delivered = False  # the client has [DONE]: a hang-up after it ends nothing it asked for
        try:
            async for chunk in dispatch.response.chunks():
                try:
                    events = reader.feed(chunk)
                except EventTooLargeError as exc:
                    raise UpstreamFailedError(str(exc)) from exc
                forward, terminal = [], False  # the events of one read go out in one write
                for event in events:
                    if (text := deltas.skeleton_text(event)) is not None:  # the usual delta: its text is all it holds
                        if text:
                            self._got_content(dispatch)
                            self._completion.append(text)
                        forward.append(event)
                        continue
                    info = deltas.parsed(event)
                    if info.has_content:
                        self._got_content(dispatch)
                    if info.text:
                        self._completion.append(info.text)
                    self._tool_call_ids += info.tool_call_ids
                    if info.finish_reasons:
                        self._finish_reasons.extend(info.finish_reasons)
                    if info.usage is not None:
                        self._take_usage(info.usage)
                    if info.kv_transfer_params is not None:
                        self._take_engine_reports(info.kv_transfer_params)
                        if any(key in info.kv_transfer_params for key in self.hidden):
                            event = event_without_params(event, self.hidden)
                    if info.error is not None:
                        self.record.status, self.record.error_type = "upstream_error", "stream_error_event"
                    if info.sequence_number is not None:
                        self._last_sequence = info.sequence_number
                    terminal = terminal or info.terminal
                    self._response_id = info.response_id or self._response_id
                    if not (info.is_usage_only and self.strip_usage):
                        forward.append(event)
                if forward:
                    ends = terminal or any(is_done(event) for event in forward)
                    if ends:
                        await self._share_answer()
                    yield b"".join(forward)  # delivered only once written: a hang-up during it is a 499
                    delivered = delivered or ends
                if time.perf_counter() > deadline:
                    raise UpstreamTimeoutError("the stream exceeded the total time limit")
            if reader.rest:
                yield reader.rest
        except UpstreamTimeoutError as exc:
            self.record.status, self.record.http_status, self.record.error_type = "timeout", 504, type(exc).__name__
            yield self._sse_error("the upstream stalled mid-stream", "timeout", "upstream_timeout")
        except UpstreamFailedError as exc:
            self.record.status, self.record.http_status, self.record.error_type = "upstream_error", 502, type(exc).__name__
            yield self._sse_error("the upstream broke the stream", "upstream_error", "upstream_failed")
        except BaseException:
            if not delivered:
                self.record.status, self.record.http_status, self.record.error_type = \
                    "cancelled", 499, "client_disconnected"
            raise
        finally:
            self._end_relay(dispatch)

    def _abandoned(self, dispatch: Dispatch) -> None:
        """The response ended before its relay began (the client left while its headers
        were going out): what the relay's end would have done, for a hang-up."""
        self.record.status, self.record.http_status, self.record.error_type = "cancelled", 499, "client_disconnected"
        self._end_relay(dispatch)

    def _end_relay(self, dispatch: Dispatch) -> None:
        self._observe_upstream(dispatch)
        dispatch.close()
        self._finish()

    def _sse_error(self, message: str, type_: str, code: str) -> bytes:
        return self.endpoint.stream_error(message, type_, code, self._last_sequence)

    # -- bookkeeping ------------------------------------------------------------------------
    def _fail(self, exc: GatewayError) -> Response:
        self.record.status, self.record.http_status = exc.record_status, exc.status
        self.record.error_type = type(exc).__name__
        return error_response(exc.status, str(exc), exc.type_, exc.param, exc.code, exc.headers)

    def _got_content(self, dispatch: Dispatch) -> None:
        """Generated content arrived: the first marks the TTFT and ends the prefill's load."""
        if self.record.first_token_at is None:
            self._mark_first_token()
            dispatch.occupancy.prefilled()

    def _mark_first_token(self) -> None:
        elapsed = time.perf_counter() - self.received
        self.record.ttft_ms = elapsed * 1e3
        self.record.first_token_at = self.started_at + timedelta(seconds=elapsed)
        metrics = self.state.metrics
        metrics.child(metrics.ttft, metrics.model_label(self.record.model)).observe(elapsed)

    def _take_engine_reports(self, params: Any) -> None:
        """Keep the engine's TTFT breakdown (a JSON object under kvrelay_ttft) with the
        record, and give the routing policy the prompt's blocks the engine reported."""
        report = TtftBreakdown.read(params.get(TTFT_KEY) if isinstance(params, dict) else None)
        if report is not None:
            self.record.ttft_breakdown = json.dumps(report.to_json())
        if self._route is not None and self.record.upstream is not None and \
                (blocks := read_prompt_blocks(params)) is not None:
            self.state.upstreams.pool.learn(self._route, self.record.upstream, blocks)

    def _take_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        self.record.prompt_tokens = _count(usage.get("prompt_tokens"))
        self.record.completion_tokens = _count(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            self.record.cached_tokens = _count(details.get("cached_tokens"))

    def _observe_upstream(self, dispatch: Dispatch) -> None:
        metrics = self.state.metrics
        metrics.child(metrics.upstream_latency, dispatch.upstream.url).observe(time.perf_counter() - dispatch.sent_at)

    def _finish(self) -> None:
        elapsed = time.perf_counter() - self.received
        rec = self.record
        rec.latency_ms = elapsed * 1e3
        rec.finished_at = self.started_at + timedelta(seconds=elapsed)
        if rec.status in ("ok", "upstream_error", "timeout", "cancelled") and rec.upstream is not None:
            completion = "".join(self._completion)
            rec.completion_sha256, rec.completion_chars = sha256_text(completion), len(completion)
            if self.state.settings.store_content:
                rec.completion_text = completion
        metrics = self.state.metrics
        metrics.in_flight.dec()
        metrics.child(metrics.requests, rec.status).inc()
        metrics.child(metrics.latency, metrics.model_label(rec.model), rec.status).observe(elapsed)
        for kind, value in (("prompt", rec.prompt_tokens), ("completion", rec.completion_tokens),
                            ("cached", rec.cached_tokens)):
            if isinstance(value, int):
                metrics.child(metrics.tokens, kind).inc(value)
        self.state.access.settle(self._charge, rec.prompt_tokens, rec.completion_tokens)
        if rec.status == "ok" and self._app_id is not None and rec.session_id and self._response_id:
            self.state.responses.remember(self._app_id, self._response_id, rec.session_id)
        if rec.status == "ok" and self._app_id is not None and rec.session_id and rec.agent_id:
            answer, calls = "".join(self._completion), tuple(dict.fromkeys(self._tool_call_ids))
            self.state.inference.observe_response(self._app_id, rec.session_id, rec.agent_id, rec.id, answer, calls)
            if self.state.replicas is not None and not self._shared:
                self.state.replicas.answered(self._app_id, rec.session_id, rec.agent_id, rec.id, answer, calls,
                                             self._response_id)
        if rec.status == "ok" and self._probe and self._probe_body and rec.upstream and self.state.prober:
            # An upstream that scores its own probes (the embedded engine) is skipped by offer().
            self.state.prober.offer(Probe(rec.upstream, self.endpoint.path, self._probe_body, *self._probe))
        end_call_span(self.span, rec, self._finish_reasons)
        self.state.writer.submit(rec)


def _count(value: Any) -> int | None:
    """A token count from an upstream's usage, or None if it is not a sane integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else None

