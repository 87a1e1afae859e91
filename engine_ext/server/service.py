"""Turns validated OpenAI requests into engine requests and engine outputs into OpenAI bodies.

One class serves both endpoints: chat and text completions differ only in how the
prompt is built and how a choice is shaped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from opentelemetry.trace import NoOpTracer, Tracer

from engine_ext.async_engine import AsyncEngine
from engine_ext.engine import RequestOutput
from engine_ext.errors import EngineError
from engine_ext.plan_seal import SEAL_KEY
from engine_ext.protocol import PLAN_KEY, AdapterRef, SegmentPlan
from engine_ext.reuse.aligner import AlignedPrompt, PromptAligner
from engine_ext.reuse.segments import DEFAULT_APP, REPORT_KEY, ReuseScope, report
from engine_ext.server.errors import ModelNotFoundError, engine_error_status, error_body
from engine_ext.server.plans import PlanReader
from engine_ext.server.schemas import ChatCompletionRequest, CompletionRequest
from engine_ext.server.tracing import emit_request_spans
from engine_ext.timeline import TTFT_KEY, Timeline, breakdown, wants_breakdown

Request = ChatCompletionRequest | CompletionRequest
logger = logging.getLogger(__name__)


class CompletionService:
    def __init__(self, engine: AsyncEngine, model_name: str, tracer: Tracer | None = None,
                 plans: PlanReader | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.plans = plans if plans is not None else PlanReader()
        self.tracer = tracer if tracer is not None else NoOpTracer()
        self.tokenizer = engine.engine.tokenizer
        self.aligner = PromptAligner(self.tokenizer)

    def models(self) -> dict[str, Any]:
        """The base model, then each adapter as `base:adapter`."""
        ids = [self.model_name] + [f"{self.model_name}:{name}" for name in self.engine.engine.adapters.names]
        cards = [{"id": model_id, "object": "model", "created": 0, "owned_by": "kvrelay",
                  "max_model_len": self.engine.engine.max_model_len} for model_id in ids]
        return {"object": "list", "data": cards}

    def _adapter(self, model: str) -> str | None:
        """The adapter a request's `model` names (`base:adapter`), None for the base.
        The last `:` splits, since adapter names have none and a base name may."""
        if model == self.model_name:
            return None
        try:
            ref = AdapterRef.of(model)
        except ValueError as exc:  # an empty base or adapter name: no such model
            raise ModelNotFoundError(model) from exc
        if ref.base != self.model_name or ref.name not in self.engine.engine.adapters.names:
            raise ModelNotFoundError(model)
        return ref.name

    # -- prompt ----------------------------------------------------------------------
    def _prompt(self, req: Request) -> tuple[AlignedPrompt, bool]:
        """Token ids of the prompt, segment-aligned when the request carries a plan, and
        whose caches it may use (its scope); and whether its plan asks for a fidelity probe."""
        self._adapter(req.model)
        req.check_supported()
        plan = self.plans.read(req.kv_transfer_params)
        if isinstance(req, ChatCompletionRequest):
            messages = [m.to_template() for m in req.messages]
            if plan is None:
                prompt = AlignedPrompt(self.tokenizer.encode(self.tokenizer.render_chat(messages, tools=req.tools)), [])
            else:
                prompt = self.aligner.chat(messages, req.tools, plan)
        else:
            text = req.prompt_input()
            if isinstance(text, list):  # token ids: nothing to align
                prompt = AlignedPrompt(text, [])
            elif plan is None:
                prompt = AlignedPrompt(self.tokenizer.encode(text), [])
            else:
                prompt = self.aligner.text(text, plan)
        return prompt._replace(scope=self._scope(plan)), plan is not None and plan.probe

    def _scope(self, plan: SegmentPlan | None) -> ReuseScope | None:
        """The plan's tenant, app and agent. Without a plan: the default tenant, except
        on an engine that follows only sealed plans, which serves such a request in a
        tenant of its own: nobody vouched for it, so it neither reads nor leaves cached
        KV for anyone."""
        if plan is not None:
            app = plan.app_id or DEFAULT_APP
            return ReuseScope(app, plan.agent_id, plan.round, plan.workflow, plan.tenant or app, plan.session_id)
        if self.plans.seal is not None:
            return ReuseScope(DEFAULT_APP, None, tenant=f"unvouched:{uuid.uuid4().hex}")
        return None

    def _outputs(self, req: Request, request_id: str,
                 line: Timeline) -> tuple[AsyncIterator[RequestOutput], str | None]:
        prompt, probe = self._prompt(req)
        max_tokens = req.resolved_max_tokens if isinstance(req, ChatCompletionRequest) else req.max_tokens
        outputs = self.engine.generate(request_id, prompt.token_ids, req.sampling_params(max_tokens),
                                       req.kv_transfer_params, prompt.segments, prompt.scope,
                                       self._adapter(req.model), line, probe)
        return outputs, prompt.note

    # -- non-streaming -----------------------------------------------------------------
    async def complete(self, req: Request, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        is_chat = isinstance(req, ChatCompletionRequest)
        request_id = _new_id(is_chat)
        text: list[str] = []
        line, last, error = Timeline(), None, "cancelled"  # stays "cancelled" if the client goes away
        try:
            outputs, note = self._outputs(req, request_id, line)
            async with contextlib.aclosing(outputs):  # leaving early aborts the request at once
                async for out in outputs:
                    text.append(out.delta_text)
                    last = out
            error = None if last is not None else "no_output"
        except Exception as exc:
            error = type(exc).__name__
            raise
        finally:
            self._trace(headers or {}, is_chat, req.model, line, last, error)
        if last is None:
            raise EngineError(f"request {request_id} ended without output")
        content = "".join(text)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
        if is_chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        body = self._envelope(req, request_id, is_chat, chunk=False)
        body["choices"] = [choice]
        body["usage"] = _usage(last)
        params = self._response_params(req, last, note, headers or {})
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    # -- streaming ---------------------------------------------------------------------
    async def stream(self, req: Request, headers: Mapping[str, str] | None = None) -> AsyncIterator[str]:
        """SSE lines. Validation errors surface before the first yield so the route can
        still answer with a proper error status."""
        is_chat = isinstance(req, ChatCompletionRequest)
        request_id = _new_id(is_chat)
        line = Timeline()
        try:
            outputs, note = self._outputs(req, request_id, line)
            first = await anext(outputs)  # raises validation errors here, before any byte is sent
        except Exception as exc:
            self._trace(headers or {}, is_chat, req.model, line, None, type(exc).__name__)
            raise
        return self._sse(req, request_id, is_chat, first, outputs, note, headers or {}, line)

    async def _sse(self, req: Request, request_id: str, is_chat: bool, first: RequestOutput,
                   rest: AsyncIterator[RequestOutput], note: str | None,
                   headers: Mapping[str, str], line: Timeline) -> AsyncIterator[str]:
        envelope = self._envelope(req, request_id, is_chat, chunk=True)

        def chunk(delta: str | None, finish_reason: str | None, role: bool = False) -> str:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
            if is_chat:
                choice["delta"] = ({"role": "assistant", "content": ""} if role
                                   else ({} if delta is None else {"content": delta}))
            else:
                choice["text"] = delta or ""
            body = {**envelope, "choices": [choice]}
            params = self._response_params(req, last, note, headers) if finish_reason is not None else None
            if params is not None:
                body["kv_transfer_params"] = params
            return _sse_line(body)

        last, error, traced = first, "cancelled", False
        try:
            if is_chat:
                yield chunk(None, None, role=True)
            out: RequestOutput | None = first
            while out is not None:
                if out.delta_text:
                    yield chunk(out.delta_text, None)
                last = out
                out = None if out.finished else await anext(rest, None)
            yield chunk(None, last.finish_reason)
            self._trace(headers, is_chat, req.model, line, last, None)
            traced = True
            if req.include_usage:
                yield _sse_line({**envelope, "choices": [], "usage": _usage(last)})
        except EngineError as exc:
            # The 200 is already sent: report the failure in-band, as OpenAI's API does,
            # so clients raise an APIError instead of seeing a truncated stream.
            error = type(exc).__name__
            _, type_ = engine_error_status(exc)
            yield _sse_line(error_body(str(exc), type_, getattr(exc, "param", None), getattr(exc, "code", None)))
        finally:
            await rest.aclose()  # aborts the request if the client went away mid-stream
            if not traced:
                self._trace(headers, is_chat, req.model, line, last if last.finished else None, error)
        yield "data: [DONE]\n\n"

    def _trace(self, headers: Mapping[str, str], is_chat: bool, model: str, line: Timeline,
               last: RequestOutput | None, error: str | None) -> None:
        """The request's spans, failed ones included; a tracing failure is logged and
        never reaches the response."""
        try:
            emit_request_spans(self.tracer, headers, _operation(is_chat), model, line, last, error)
        except Exception:
            logger.exception("emitting the spans of a %s request failed", model)

    def _response_params(self, req: Request, last: RequestOutput, note: str | None,
                         headers: Mapping[str, str]) -> dict[str, Any] | None:
        """The request's kv_transfer_params echoed back, with what reuse did per segment
        and, for a caller that sent kv_transfer_params or the TTFT header (the gateway),
        the TTFT breakdown."""
        sent = isinstance(req.kv_transfer_params, dict)
        # The caller's other entries come back; its plan and seal never do (they name
        # tenants and content hashes).
        params = {k: v for k, v in req.kv_transfer_params.items() if k not in (PLAN_KEY, SEAL_KEY)} if sent else None
        if last.reuse_outcomes is not None or note:
            params = params if params is not None else {}
            params[REPORT_KEY] = report(last.reuse_outcomes or [], note)
        if (sent or wants_breakdown(headers)) and last.timeline is not None:
            params = params if params is not None else {}
            # Priced in the engine thread at the prompt's first step (its timeline's baseline).
            params[TTFT_KEY] = breakdown(last.timeline, last.num_prompt_tokens)
        return params

    def _envelope(self, req: Request, request_id: str, is_chat: bool, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if is_chat else "text_completion"
        # The model the client asked for: the base, or `base:adapter` (validated in _prompt).
        return {"id": request_id, "object": kind, "created": int(time.time()), "model": req.model}


def _operation(is_chat: bool) -> str:
    return "chat" if is_chat else "text_completion"


def _new_id(is_chat: bool) -> str:
    return ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def _sse_line(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
