"""This gateway's part in a group of replicas: what it tells the others, what it takes in.

The request path calls `planned` once a request is planned and `answered` once its
answer is relayed; routing tells `homed` through SessionHomes.on_settle. Each becomes an
observation in the shared log (kvrelay/gateway/inference/replication.py), and `apply`
takes the others' observations into this replica's inference state, session homes and
Responses-API continuations, exactly as if it had handled those requests itself.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from kvrelay.gateway.endpoints.responses import ResponseSessions
from kvrelay.gateway.identity import Identity
from kvrelay.gateway.inference import Inference
from kvrelay.gateway.inference.replication import SharedLog
from kvrelay.gateway.settings import ReplicationSettings
from kvrelay.gateway.supervisor import SupervisedTask
from kvrelay.gateway.upstreams import UpstreamPool


def default_replica_id() -> str:
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Replicas:
    def __init__(self, engine: AsyncEngine, settings: ReplicationSettings, inference: Inference, pool: UpstreamPool,
                 responses: ResponseSessions) -> None:
        self.inference = inference
        inference.agreed_session_ids = True  # a session two replicas start at once is one (session_ids.py)
        self.pool = pool
        self.responses = responses
        self.log = SharedLog(engine, settings.replica_id or default_replica_id(), self.apply,
                             settings.poll_interval_s, settings.retention_s)
        self.barrier_s = settings.barrier_ms / 1e3
        pool.homes.shared = True
        pool.homes.on_settle = self.homed
        self.tasks = [SupervisedTask("kvrelay-replication-append", self.log.append_loop),
                      SupervisedTask("kvrelay-replication-tail", self.log.tail_loop)]

    async def start(self) -> None:
        await self.log.start()
        for task in self.tasks:
            task.start()

    async def stop(self, drain_s: float = 5.0) -> None:
        """Share what is still queued (bounded by drain_s), then stop."""
        await self.log.drained(drain_s)
        for task in self.tasks:
            await task.stop()
        await self.log.close()

    # -- told to the others -------------------------------------------------------------------
    def planned(self, ident: Identity, view: dict[str, Any], request_id: str, model: str, session_id: str) -> None:
        self.log.publish("plan", {"ident": list(ident), "view": view, "request_id": request_id, "model": model,
                                  "session_id": session_id})

    def answered(self, app_id: str, session_id: str, agent_id: str, request_id: str, text: str,
                 tool_call_ids: tuple[str, ...], response_id: str | None) -> int:
        return self.log.publish("answer", {"app_id": app_id, "session_id": session_id, "agent_id": agent_id,
                                           "request_id": request_id, "text": text,
                                           "tool_call_ids": list(tool_call_ids), "response_id": response_id})

    async def share_answer(self, app_id: str, session_id: str, agent_id: str, request_id: str, text: str,
                           tool_call_ids: tuple[str, ...], response_id: str | None) -> None:
        """`answered`, then wait (at most the barrier) until it is committed: the client
        that gets the answer's end after this can only quote it in a later request, which
        any replica then plans with it (`catch_up`)."""
        ticket = self.answered(app_id, session_id, agent_id, request_id, text, tool_call_ids, response_id)
        if self.barrier_s > 0:
            await self.log.appended(ticket, self.barrier_s)

    async def catch_up(self) -> None:
        """Before planning: apply what the others have committed and this replica not yet
        read (at most the barrier; nothing to do, and no query, when there is no news)."""
        if self.barrier_s > 0:
            await self.log.catch_up(self.barrier_s)

    def homed(self, session_id: str, url: str) -> None:
        self.log.publish("home", {"session_id": session_id, "url": url})

    # -- taken in from the others -------------------------------------------------------------
    def apply(self, kind: str, payload: dict[str, Any]) -> None:
        """Raises KeyError, TypeError or ValueError on a payload it cannot read."""
        if kind == "plan":
            app_id, session, agent = payload["ident"]
            ident = Identity(str(app_id), _optional(session), _optional(agent))
            if not isinstance(payload["view"], dict):
                raise TypeError("view: not an object")
            self.inference.plan(ident, payload["view"], str(payload["request_id"]), str(payload["model"]),
                                replay_in=str(payload["session_id"]))
        elif kind == "answer":
            app_id, session_id = str(payload["app_id"]), str(payload["session_id"])
            self.inference.observe_response(app_id, session_id, str(payload["agent_id"]),
                                            str(payload["request_id"]), str(payload["text"]),
                                            tuple(str(c) for c in payload["tool_call_ids"]))
            if payload.get("response_id"):
                self.responses.remember(app_id, str(payload["response_id"]), session_id)
        elif kind == "home":
            home = next((u for u in self.pool.upstreams if u.url == payload["url"]), None)
            if home is None:
                raise ValueError(f"no upstream {payload['url']!r} here")
            self.pool.homes.settle(str(payload["session_id"]), home, tell=False)
        else:
            raise ValueError(f"unknown observation kind {kind!r}")


def _optional(value: Any) -> str | None:
    return None if value is None else str(value)
