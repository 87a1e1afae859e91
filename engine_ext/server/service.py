"""Turns validated OpenAI requests into engine requests and engine outputs into OpenAI bodies.

One class serves both endpoints: chat and text completions differ only in how the
prompt is built and how a choice is shaped (engine_ext/server/choices.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import logging
import uuid
from collections.abc import AsyncGenerator, Mapping
from typing import Any

from opentelemetry.trace import NoOpTracer, Tracer

from engine_ext.async_engine import AsyncEngine
from engine_ext.engine import RequestOutput
from engine_ext.errors import EngineError, InvalidRequestError
from kvrelay.wire.salt import salted_tenant
from kvrelay.wire.seal import SEAL_KEY
from kvrelay.wire.plan import PLAN_KEY, AdapterRef, SegmentPlan
from engine_ext.reuse.aligner import AlignedPrompt, PromptAligner
from engine_ext.kv.hashing import DEFAULT_TENANT
from engine_ext.reuse.segments import DEFAULT_APP, ReuseScope, report
from engine_ext.server.choices import Choices, choices_for, finish_with_calls
from engine_ext.server.errors import ModelNotFoundError, engine_error_status, error_body
from engine_ext.server.plans import MessageShift, PlanReader
from engine_ext.server.schemas import ChatCompletionRequest, ChatTool, CompletionRequest
from engine_ext.server.shaping import ChatShape, shape_chat
from engine_ext.structured.grammar import Grammar, GrammarCompiler, TokenConstraint
from engine_ext.tools.calls import ToolCall
from engine_ext.tools.formats import FORMATS, pick_format
from engine_ext.tools.formats.generic import AutoPolicy, GenericFormat
from engine_ext.server.tracing import emit_request_spans
from engine_ext.timeline import Timeline, breakdown
from engine_ext.request import EngineRequest
from kvrelay.wire.cache_report import BLOCKS_KEY, digests, wants_blocks
from kvrelay.wire.reports import REUSE_KEY, TTFT_KEY, wants_breakdown

Request = ChatCompletionRequest | CompletionRequest
logger = logging.getLogger(__name__)


class CompletionService:
    def __init__(self, engine: AsyncEngine, model_name: str, tracer: Tracer | None = None,
                 plans: PlanReader | None = None, generic_tool_auto: AutoPolicy = "call-first") -> None:
        self.engine = engine
        self.model_name = model_name
        self.plans = plans if plans is not None else PlanReader()
        self.tracer = tracer if tracer is not None else NoOpTracer()
        self.tokenizer = engine.model.tokenizer
        self.aligner = PromptAligner(self.tokenizer)
        self.tool_format = pick_format(self.tokenizer, FORMATS)  # how this model's template takes tools
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        if isinstance(self.tool_format, GenericFormat):
            self.tool_format.auto_policy = generic_tool_auto

    def models(self) -> dict[str, Any]:
        """The base model, then each adapter as `base:adapter`."""
        ids = [self.model_name] + [f"{self.model_name}:{name}" for name in self.engine.model.adapter_names]
        cards = [{"id": model_id, "object": "model", "created": 0, "owned_by": "kvrelay",
                  "max_model_len": self.engine.model.max_model_len} for model_id in ids]
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
        if ref.base != self.model_name or ref.name not in self.engine.model.adapter_names:
            raise ModelNotFoundError(model)
        return ref.name

    # -- prompt ----------------------------------------------------------------------
    def _prompt(self, req: Request, shift: MessageShift | None) -> tuple[AlignedPrompt, bool, ChatShape | None]:
        """Token ids of the prompt, segment-aligned when the request carries a plan, and
        whose caches it may use (its scope); whether its plan asks for a fidelity probe;
        and, for a chat, the shape its answer must take (engine_ext/server/shaping.py).
        `shift`: messages the engine inserted after the gateway planned (a Responses
        request's stored history), which the plan's segments move past."""
        self._adapter(req.model)
        req.check_supported()
        plan = self.plans.read(req.kv_transfer_params, shift)
        shape = None
        if isinstance(req, ChatCompletionRequest):
            shape = shape_chat(req, self.tool_format)
            if plan is None:
                text = self.tokenizer.render_chat(shape.messages, tools=shape.tools)
                prompt = AlignedPrompt(self.tokenizer.encode(text), [])
            else:
                prompt = self.aligner.chat(shape.messages, shape.tools, shape.plan_for_template(plan))
        else:
            given = req.prompt_input()
            if isinstance(given, list):  # token ids: nothing to align
                prompt = AlignedPrompt(given, [])
            elif plan is None:
                prompt = AlignedPrompt(self.tokenizer.encode(given), [])
            else:
                prompt = self.aligner.text(given, plan)
        return prompt._replace(scope=self._scope(plan, req.cache_salt)), plan is not None and plan.probe, shape

    def _scope(self, plan: SegmentPlan | None, salt: str | None) -> ReuseScope | None:
        """The plan's tenant, app and agent. Without a plan: the default tenant, except
        on an engine that follows only sealed plans, which serves such a request in a
        tenant of its own: nobody vouched for it, so it neither reads nor leaves cached
        KV for anyone. A cache_salt splits the tenant as it splits vLLM's cache."""
        if plan is not None:
            app = plan.app_id or DEFAULT_APP
            tenant = plan.tenant or app
            return ReuseScope(app, plan.agent_id, plan.round, plan.workflow, salted_tenant(tenant, salt),
                              plan.session_id, named_tenant=tenant)
        if self.plans.seal is not None:
            return ReuseScope(DEFAULT_APP, None, tenant=f"unvouched:{uuid.uuid4().hex}")
        if salt is not None:
            return ReuseScope(DEFAULT_APP, None, tenant=salted_tenant(DEFAULT_TENANT, salt))
        return None

    async def _outputs(self, req: Request, request_id: str, line: Timeline, shift: MessageShift | None
                       ) -> tuple[AsyncGenerator[RequestOutput, None], str | None, ChatShape | None]:
        prompt, probe, shape = self._prompt(req, shift)
        max_tokens = req.resolved_max_tokens if isinstance(req, ChatCompletionRequest) else req.max_tokens
        sampling = req.sampling_params(max_tokens)
        if shape is not None and shape.grammar is not None:
            # Building a matcher can take a while for a large schema: off the event loop.
            grammar = shape.grammar
            constraint = await asyncio.to_thread(lambda: self._constraint(req, grammar))
            sampling = dataclasses.replace(sampling, constraint=constraint)
        request = EngineRequest(request_id, prompt.token_ids, sampling, req.kv_transfer_params, prompt.segments,
                                prompt.scope, self._adapter(req.model), probe=probe)
        outputs = self.engine.generate(request, line)
        return outputs, prompt.note, shape

    def _constraint(self, req: Request, grammar: Grammar) -> TokenConstraint:
        """The answer's constraint. The answer has one grammar, lenient unless every tool
        is strict: beside non-strict tools, a strict tool's schema is first compiled on
        its own, so a keyword that cannot be enforced is refused, not ignored. When the
        grammar fails, the tool whose schema is why is named."""
        tools = list(enumerate(req.tools or ())) if isinstance(req, ChatCompletionRequest) else []
        if tools and not all(tool.function.strict for _, tool in tools):
            self._check_tools([(i, tool) for i, tool in tools if tool.function.strict])
        try:
            return self.grammars.constraint(grammar)
        except InvalidRequestError:
            self._check_tools(tools)  # raises naming the culprit, if a tool's schema is it
            raise

    def _check_tools(self, tools: list[tuple[int, ChatTool]]) -> None:
        for i, tool in tools:
            function, param = tool.function, f"tools[{i}].function.parameters"
            if function.parameters is not None:
                try:
                    self.grammars.constraint(Grammar.json_schema(function.parameters, param, not function.strict))
                except InvalidRequestError as exc:
                    raise InvalidRequestError(str(exc), param=param) from exc

    @property
    def grammars(self) -> GrammarCompiler:
        """Built on the first constrained request (it indexes the whole vocabulary once,
        in a worker thread: two first requests must not both build it)."""
        with self._grammars_lock:
            if self._grammars is None:
                model = self.engine.model
                self._grammars = GrammarCompiler(self.tokenizer.to_json(), model.vocab_size, model.eos_token_ids)
            return self._grammars

    # -- non-streaming -----------------------------------------------------------------
    async def complete(self, req: Request, headers: Mapping[str, str] | None = None,
                       shift: MessageShift | None = None) -> dict[str, Any]:
        choices = choices_for(req)
        request_id = choices.new_id()
        text: list[str] = []
        line, last = Timeline(), None
        error: str | None = "cancelled"  # stays "cancelled" if the client goes away
        try:
            outputs, note, shape = await self._outputs(req, request_id, line, shift)
            async with contextlib.aclosing(outputs):  # leaving early aborts the request at once
                async for out in outputs:
                    text.append(out.delta_text)
                    last = out
            error = None if last is not None else "no_output"
        except Exception as exc:
            error = type(exc).__name__
            raise
        finally:
            self._trace(headers or {}, choices, req.model, line, last, error)
        if last is None:
            raise EngineError(f"request {request_id} ended without output")
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
        choices.answer(choice, "".join(text), shape)
        body = choices.envelope(request_id, req.model, chunk=False)
        body["choices"] = [choice]
        body["usage"] = _usage(last)
        params = self._response_params(req, last, note, headers or {})
        if params is not None:
            body["kv_transfer_params"] = params
        return body

    # -- streaming ---------------------------------------------------------------------
    async def stream(self, req: Request, headers: Mapping[str, str] | None = None,
                     shift: MessageShift | None = None) -> AsyncGenerator[str, None]:
        """SSE lines. Validation errors surface before the first yield so the route can
        still answer with a proper error status."""
        choices = choices_for(req)
        request_id = choices.new_id()
        line = Timeline()
        try:
            outputs, note, shape = await self._outputs(req, request_id, line, shift)
            first = await anext(outputs)  # raises validation errors here, before any byte is sent
        except Exception as exc:
            self._trace(headers or {}, choices, req.model, line, None, type(exc).__name__)
            raise
        return self._sse(req, request_id, choices, first, outputs, note, headers or {}, line, shape)

    async def _sse(self, req: Request, request_id: str, choices: Choices, first: RequestOutput,
                   rest: AsyncGenerator[RequestOutput, None], note: str | None,
                   headers: Mapping[str, str], line: Timeline, shape: ChatShape | None
                   ) -> AsyncGenerator[str, None]:
        reader = shape.stream() if shape is not None else None
        envelope = choices.envelope(request_id, req.model, chunk=True)

        def chunk(delta: str | None, finish_reason: str | None, role: bool = False,
                  calls: tuple[ToolCall, ...] = ()) -> str:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
            choices.delta(choice, delta, role, calls)
            body = {**envelope, "choices": [choice]}
            params = self._response_params(req, last, note, headers) if finish_reason is not None else None
            if params is not None:
                body["kv_transfer_params"] = params
            return _sse_line(body)

        last, error, traced = first, "cancelled", False
        try:
            if choices.opens_with_role:
                yield chunk(None, None, role=True)
            out: RequestOutput | None = first
            answer = ""  # the whole text so far, which a tool format reads
            while out is not None:
                answer += out.delta_text
                delta = reader.feed(answer) if reader is not None else out.delta_text
                if delta:
                    yield chunk(delta, None)
                last = out
                out = None if out.finished else await anext(rest, None)
            finish_reason = last.finish_reason
            if reader is not None:
                delta, calls = reader.finish(answer)
                calls = shape.kept(calls) if shape is not None else calls
                if delta:
                    yield chunk(delta, None)
                if calls:
                    yield chunk(None, None, calls=calls)
                    finish_reason = finish_with_calls(finish_reason)
            yield chunk(None, finish_reason)
            self._trace(headers, choices, req.model, line, last, None)
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
                self._trace(headers, choices, req.model, line, last if last.finished else None, error)
        yield "data: [DONE]\n\n"

    def _trace(self, headers: Mapping[str, str], choices: Choices, model: str, line: Timeline,
               last: RequestOutput | None, error: str | None) -> None:
        """The request's spans, failed ones included; a tracing failure is logged and
        never reaches the response."""
        try:
            emit_request_spans(self.tracer, headers, choices.operation, model, line, last, error)
        except Exception:
            logger.exception("emitting the spans of a %s request failed", model)

    def _response_params(self, req: Request, last: RequestOutput, note: str | None,
                         headers: Mapping[str, str]) -> dict[str, Any] | None:
        """The request's kv_transfer_params echoed back, with what reuse did per segment;
        for a caller that sent kv_transfer_params or the TTFT header (the gateway), the
        TTFT breakdown; for one that sent the blocks header, the prompt's block digests."""
        # The caller's other entries come back; its plan and seal never do (they name
        # tenants and content hashes).
        given = req.kv_transfer_params
        params = {k: v for k, v in given.items() if k not in (PLAN_KEY, SEAL_KEY)} if isinstance(given, dict) else None
        sent = params is not None
        if last.reuse_outcomes is not None or note:
            params = params if params is not None else {}
            params[REUSE_KEY] = report(last.reuse_outcomes or [], note)
        if (sent or wants_breakdown(headers)) and last.timeline is not None:
            params = params if params is not None else {}
            # Priced in the engine thread at the prompt's first step (its timeline's baseline).
            if (ttft := breakdown(last.timeline, last.num_prompt_tokens)) is not None:
                params[TTFT_KEY] = ttft.to_json()
        if wants_blocks(headers) and last.prompt_blocks:
            params = params if params is not None else {}
            params[BLOCKS_KEY] = digests(last.prompt_blocks)  # for the gateway's cache-aware routing
        return params


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


def _sse_line(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
