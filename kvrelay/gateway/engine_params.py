"""kv_transfer_params between the client, the gateway and the engine.

Inbound, the gateway drops any plan or seal a client put there: the engine follows
only plans the gateway built (and, with a secret, sealed: kvrelay/wire/seal.py).
Outbound to the engine, it attaches its own plan and seal. Back to the client, it
removes what the engine echoed of them, and the engine's TTFT breakdown unless the
client asked for it: the plan names tenants and content hashes, the breakdown tells
of other requests' load.
"""

from __future__ import annotations

from typing import Any

from kvrelay.wire.seal import SEAL_KEY, PlanSeal
from kvrelay.wire.plan import PLAN_KEY, SegmentPlan, attach_plan
from kvrelay.wire.cache_report import BLOCKS_KEY
from kvrelay.wire.reports import TTFT_KEY
from kvrelay.json_codec import dumps, loads

PRIVATE_KEYS = (PLAN_KEY, SEAL_KEY)  # never from a client, never back to one


def without_client_plan(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body with no plan or seal of its own in kv_transfer_params."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or not any(key in params for key in PRIVATE_KEYS):
        return body
    return without_params(body, PRIVATE_KEYS)


def with_plan(body: dict[str, Any], plan: SegmentPlan | dict[str, Any], seal: PlanSeal | None) -> dict[str, Any]:
    """The upstream body with the gateway's plan (or its model_dump(mode="json")), sealed
    when a secret is configured."""
    body = attach_plan(body, plan)
    if seal is not None:
        body["kv_transfer_params"][SEAL_KEY] = seal.seal(body["kv_transfer_params"][PLAN_KEY])
    return body


def hidden_from_client(shows_ttft: bool) -> tuple[str, ...]:
    """What the engine echoes that the client does not see: the plan and seal, the
    prompt's block digests (for routing), and the TTFT breakdown unless it asked."""
    return (*PRIVATE_KEYS, BLOCKS_KEY) if shows_ttft else (*PRIVATE_KEYS, BLOCKS_KEY, TTFT_KEY)


def without_params(body: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """The body without those kv_transfer_params entries (and without kv_transfer_params
    if nothing else is left in it)."""
    params = {k: v for k, v in body["kv_transfer_params"].items() if k not in keys}
    rest = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    return {**rest, "kv_transfer_params": params} if params else rest


def event_without_params(event: bytes, keys: tuple[str, ...]) -> bytes:
    """An SSE event whose data JSON holds kv_transfer_params (a chat chunk's, or the
    Response's in a Responses event), re-encoded without `keys`; its other fields (the
    `event:` name) kept."""
    lines = event.splitlines()
    data = b"".join(line[5:].lstrip() for line in lines if line.startswith(b"data:"))
    body = loads(data)
    response = body.get("response")
    if "kv_transfer_params" not in body and isinstance(response, dict) and "kv_transfer_params" in response:
        body = {**body, "response": without_params(response, keys)}
    else:
        body = without_params(body, keys)
    fields = b"".join(line + b"\n" for line in lines if line and not line.startswith(b"data:"))
    return fields + b"data: " + dumps(body) + b"\n\n"
