"""The OpenAI routes the gateway fronts, each an `Endpoint` (kvrelay/gateway/endpoints/base.py)."""

from __future__ import annotations

from types import MappingProxyType

from kvrelay.gateway.endpoints.base import AnswerFacts, Endpoint, PromptView
from kvrelay.gateway.endpoints.completions import ChatCompletions, Completions
from kvrelay.gateway.endpoints.responses import Responses, ResponseSessions

ENDPOINTS = MappingProxyType({endpoint.path: endpoint for endpoint in (ChatCompletions(), Completions(), Responses())})

__all__ = ["ENDPOINTS", "AnswerFacts", "ChatCompletions", "Completions", "Endpoint", "PromptView", "Responses",
           "ResponseSessions"]
