"""SegmentPlan: what the gateway tells the engine about a request's prompt (version 1).

The gateway attaches a plan to the upstream body as `kv_transfer_params["kvrelay"]`
(vLLM's field for connector parameters, so the same body works for the embedded engine
and for vLLM with the kvrelay connector). A plan covers every character of every
message with segments, in order:

- `fixed_prefix`: the learned fixed part of the agent's system prompt;
- `placeholder`: text equal to an earlier response of the session, a tool result or
  the shared user question, named by the KVCOMM convention (`user_question`,
  `agent_<id>_current`, `agent_<id>_history_<k>`, `condition_<id>_current`,
  `condition_<id>_history_<k>`);
- `shared_block`: a delimited block that recurs across requests (e.g. a retrieved
  document), keyed by its content hash even though no response produced it;
- `private`: everything else.

Offsets are Python string indices into the message's `content` (for /v1/completions, the
prompt is message 0). `content_hash` is the sha256 of the segment's text, so the engine
can check that what it holds is what the plan claims. A plan is advice: an engine that
cannot reuse a segment as planned computes it densely.

`adapter` names the base model and the LoRA adapter the request runs on, apart, so an
engine (and the gateway's routing) can tell that `base:a` and `base:b` share the base's
KV cache (ICaRus mode) without parsing model names.
"""

from __future__ import annotations


from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from kvrelay.json_codec import dumps_text

PLAN_VERSION: Final = 1
PLAN_KEY = "kvrelay"  # the key under kv_transfer_params
MAX_PLAN_SEGMENTS = 4096  # a longer plan is malformed: the engine ignores it

SegmentKind = Literal["fixed_prefix", "placeholder", "shared_block", "private"]
# How the engine may reuse a segment's cached KV (engine_ext/reuse); None: its default.
ReuseMethod = Literal["prefix", "shift", "blend", "link", "kvcomm", "dense"]
NonNegative = Annotated[int, Field(ge=0)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Segment(_Frozen):
    message_index: NonNegative
    char_start: NonNegative
    char_end: NonNegative
    kind: SegmentKind
    name: str | None = None  # placeholder name; the agent id for a fixed prefix
    content_hash: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    source_request: str | None = None  # the request whose output (or prompt) it came from
    method: ReuseMethod | None = None

    @model_validator(mode="after")
    def _span(self) -> Segment:
        if self.char_end <= self.char_start:
            raise ValueError(f"segment [{self.char_start}, {self.char_end}) is empty")
        if self.kind == "placeholder" and not self.name:
            raise ValueError("a placeholder segment needs a name")
        return self


class RoundInfo(_Frozen):
    """An All-Gather round: requests that each read the same set of previous outputs."""

    id: str
    size: Annotated[int, Field(ge=1)]  # expected number of requests, learned from earlier rounds
    index: NonNegative  # this request's position in the round


class WorkflowInfo(_Frozen):
    steps_to_execution: dict[str, NonNegative]  # agent id -> steps until it runs (0: running now)
    next: list[str]  # the agents predicted to run next


class AdapterRef(_Frozen):
    """A base model and the adapter on it; `name` None is the base model itself."""

    base: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)] | None = None

    @property
    def model(self) -> str:
        """The model name a client sends and an engine lists: `base` or `base:name`."""
        return self.base if self.name is None else f"{self.base}:{self.name}"

    @classmethod
    def of(cls, model: str) -> AdapterRef:
        """Parse a model name (`base` or `base:name`)."""
        return cls(**_model_parts(model))

    @model_validator(mode="before")
    @classmethod
    def _from_model_name(cls, value: Any) -> Any:
        """Plans from gateways before AdapterRef carried the model name as a string."""
        return _model_parts(value) if isinstance(value, str) else value


def _model_parts(model: str) -> dict[str, str]:
    """`base:name` splits at the last ':' (adapter names have none, a base name may); a
    name with an empty part is a base of its own."""
    base, sep, name = model.rpartition(":")
    return {"base": base, "name": name} if sep and base and name else {"base": model}


class SegmentPlan(_Frozen):
    version: Literal[1] = PLAN_VERSION
    session_id: str
    agent_id: str | None
    request_id: str
    segments: Annotated[list[Segment], Field(max_length=MAX_PLAN_SEGMENTS)]
    round: RoundInfo | None = None
    workflow: WorkflowInfo | None = None
    adapter: AdapterRef | None = None
    app_id: str | None = None  # whose workflow this is: KVCOMM anchors are learned per app
    # Whose caches the request may read and fill (every engine cache is namespaced by it);
    # None: the app's. Set by the gateway from the API key; tenants configured to share
    # get one name.
    tenant: str | None = Field(default=None, min_length=1, max_length=256)
    # The gateway's fidelity guard asks the engine to score this (approximate) request
    # again densely on spare capacity and report top-1 agreement and KL (engine_ext/probes.py).
    probe: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> SegmentPlan:
        previous: Segment | None = None
        for segment in self.segments:
            if previous is not None and (segment.message_index, segment.char_start) < \
                    (previous.message_index, previous.char_end):
                raise ValueError("segments must be in order and must not overlap")
            previous = segment
        return self


def attach_plan(body: dict[str, Any], plan: SegmentPlan | dict[str, Any]) -> dict[str, Any]:
    """The body with the plan under kv_transfer_params, keeping the client's other entries.
    `plan`: the plan, or its model_dump(mode="json") when the caller has it already."""
    params = body.get("kv_transfer_params")
    params = dict(params) if isinstance(params, dict) else {}
    params[PLAN_KEY] = plan if isinstance(plan, dict) else plan.model_dump(mode="json")
    return {**body, "kv_transfer_params": params}


def plan_text(values: dict[str, Any]) -> str:
    """The JSON text of a plan from its model_dump(mode="json"): the same text as
    model_dump_json (compact, UTF-8 unescaped; a plan holds no float), without building it
    from the model a second time when the values are at hand."""
    return dumps_text(values)


def read_plan(body: dict[str, Any]) -> SegmentPlan | None:
    """The plan in a request body, or None; raises pydantic.ValidationError if malformed."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or PLAN_KEY not in params:
        return None
    return SegmentPlan.model_validate(params[PLAN_KEY])
