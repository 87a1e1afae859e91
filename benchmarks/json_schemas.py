"""Seeded JSON Schemas shaped like what agent apps send for structured output and tool calls.

`kvrelay bench grammars` compiles these with each grammar library and walks a valid
instance through its matcher. The schemas copy the shapes seen in agent traffic
(response_format json_schema and tool `parameters`): closed objects with required and
optional properties, nesting two or three levels deep, arrays of objects or strings with
item bounds, enums and const discriminators, bounded integers and numbers, nullable
fields written both ways (type lists and anyOf with null), anyOf/oneOf of object shapes,
$defs + $ref, and a few `pattern` and `format` strings. Every string is bounded (most
maxLength 8-40, formats and patterns by construction) so that a small model under the
grammar cannot run on forever inside a string, and every schema is satisfiable: the
tests build an instance for each with `example_instance` and validate it with jsonschema.
Properties come in the order the instance writes them, because xgrammar and
outlines-core follow the declared order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

Schema = dict[str, Any]


def _str(rng: random.Random, lo: int = 1, hi: int | None = None) -> Schema:
    return {"type": "string", "minLength": lo, "maxLength": hi if hi is not None else rng.randint(8, 40)}


def _int(lo: int, hi: int) -> Schema:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _num(lo: float, hi: float) -> Schema:
    return {"type": "number", "minimum": lo, "maximum": hi}


def _enum(*values: Any) -> Schema:
    return {"type": "string", "enum": list(values)}


_BOOL: Schema = {"type": "boolean"}
_DATE: Schema = {"type": "string", "format": "date"}
_EMAIL: Schema = {"type": "string", "format": "email", "maxLength": 40}


def _pattern(regex: str, example: str) -> Schema:
    return {"type": "string", "pattern": regex, "examples": [example]}


def _nullable(rng: random.Random, schema: Schema) -> Schema:
    """Both spellings agents send: a type list, or anyOf with null."""
    if "type" in schema and "enum" not in schema and rng.random() < 0.5:
        return {**schema, "type": [schema["type"], "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def _arr(items: Schema, lo: int, hi: int) -> Schema:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


def _obj(rng: random.Random, required: dict[str, Schema], optional: dict[str, Schema] | None = None,
         closed: bool | None = None) -> Schema:
    """An object with every required property and a random subset of the optional ones."""
    kept = {k: v for k, v in (optional or {}).items() if rng.random() < 0.75}
    schema: Schema = {"type": "object", "properties": {**required, **kept}, "required": list(required)}
    if closed if closed is not None else rng.random() < 0.8:
        schema["additionalProperties"] = False
    return schema


def _weather(r: random.Random) -> Schema:
    wind = _obj(r, {"speed_kmh": _num(0, 250), "direction": _enum("N", "NE", "E", "SE", "S", "SW", "W", "NW")})
    return _obj(r, {"city": _str(r), "date": _DATE, "temperature_c": _num(-40, 55),
                    "conditions": _enum(*r.sample(["sunny", "cloudy", "rain", "snow", "storm", "fog"], 4))},
                {"humidity_pct": _int(0, 100), "wind": wind, "alerts": _arr(_str(r), 0, r.randint(2, 4)),
                 "note": _nullable(r, _str(r))})


def _ticket(r: random.Random) -> Schema:
    reporter = _obj(r, {"name": _str(r), "email": _EMAIL})
    return _obj(r, {"ticket_id": _pattern("^[A-Z]{3}-[0-9]{2}$", "OPS-42"), "title": _str(r, 3),
                    "priority": _enum("low", "medium", "high", "urgent"), "status": {"const": "open"}},
                {"reporter": reporter, "tags": _arr(_str(r, 1, 16), 1, r.randint(3, 6)),
                 "assignee": _nullable(r, _str(r))})


def _plan(r: random.Random) -> Schema:
    step = _obj(r, {"step": _int(1, 20), "action": _str(r, 3),
                    "tool": _enum(*r.sample(["search", "calculator", "code", "browser", "none"], 3))},
                {"done": _BOOL})
    return _obj(r, {"goal": _str(r, 3), "steps": _arr(step, 1, r.randint(3, 8))},
                {"estimated_minutes": _int(1, 600), "risks": _arr(_str(r), 0, 3)})


def _search_args(r: random.Random) -> Schema:
    filters = _obj(r, {}, {"site": _nullable(r, _str(r)), "after": _DATE, "language": _enum("en", "fr", "de")})
    return _obj(r, {"query": _str(r, 2), "top_k": _int(1, r.choice([10, 20, 50]))},
                {"filters": filters, "safe_search": _BOOL})


def _event(r: random.Random) -> Schema:
    room = _obj(r, {"kind": {"const": "room"}, "room": _str(r)}, closed=True)
    video = _obj(r, {"kind": {"const": "video"}, "link": _str(r)}, closed=True)
    attendee = _obj(r, {"name": _str(r)}, {"email": _EMAIL})
    return _obj(r, {"title": _str(r, 3), "start": _DATE, "duration_minutes": _int(5, 480),
                    "location": {"oneOf": [room, video]}},
                {"attendees": _arr(attendee, 1, r.randint(3, 8)), "recurring": _BOOL})


def _order(r: random.Random) -> Schema:
    address = _obj(r, {"street": _str(r), "city": _str(r), "postcode": _pattern("^[0-9]{5}$", "75011"),
                       "country": _enum("FR", "DE", "US", "GB")})
    line = _obj(r, {"sku": _pattern("^[A-Z]{2}[0-9]{4}$", "AB1234"), "quantity": _int(1, 99),
                    "unit_price": _num(0, 10000)})
    ref = {"$ref": "#/$defs/address"}
    schema = _obj(r, {"order_id": _pattern("^ORD-[0-9]{6}$", "ORD-004217"),
                      "items": _arr({"$ref": "#/$defs/line_item"}, 1, r.randint(3, 10)), "shipping": ref},
                  {"billing": {"anyOf": [ref, {"type": "null"}]}, "gift": _BOOL})
    return {**schema, "$defs": {"address": address, "line_item": line}}


def _review(r: random.Random) -> Schema:
    comment = _obj(r, {"line": _int(1, 5000), "severity": _enum("info", "warning", "error"), "message": _str(r, 3)})
    return _obj(r, {"file": _str(r), "verdict": _enum("approve", "request_changes", "comment"),
                    "comments": _arr(comment, 0, r.randint(3, 6))}, {"approved": _BOOL, "summary": _str(r)})


def _profile(r: random.Random) -> Schema:
    notifications = _obj(r, {"email": _BOOL, "sms": _BOOL}, {"digest": _enum("daily", "weekly", "never")})
    preferences = _obj(r, {"theme": _enum("light", "dark")}, {"notifications": notifications})
    return _obj(r, {"username": _pattern("^[a-z][a-z0-9_]{2,15}$", "ana_k"), "email": _EMAIL},
                {"age": {"type": ["integer", "null"], "minimum": 13, "maximum": 120},
                 "preferences": preferences, "bio": _str(r, 0)})


def _classify(r: random.Random) -> Schema:
    labels = r.sample(["billing", "bug", "feature", "question", "praise", "spam", "security"], r.randint(3, 6))
    return _obj(r, {"label": _enum(*labels), "confidence": _num(0, 1)},
                {"rationale": _str(r), "secondary_labels": _arr(_enum(*labels), 0, 2)})


def _agent_action(r: random.Random) -> Schema:
    shapes = [_obj(r, {"action": {"const": "search"}, "query": _str(r, 2)}, closed=True),
              _obj(r, {"action": {"const": "answer"}, "text": _str(r)}, {"citations": _arr(_str(r), 0, 3)}, True),
              _obj(r, {"action": {"const": "ask_user"}, "question": _str(r, 3)}, closed=True)]
    r.shuffle(shapes)
    return {"type": "object", r.choice(["oneOf", "anyOf"]): shapes}


def _contact(r: random.Random) -> Schema:
    return _obj(r, {"name": _str(r), "phone": _pattern("^\\+[0-9]{7,12}$", "+33612345678")},
                {"company": {"type": ["string", "null"], "maxLength": r.randint(8, 40)}, "email": _EMAIL,
                 "job_title": _str(r)})


def _meeting(r: random.Random) -> Schema:
    item = _obj(r, {"owner": _str(r), "task": _str(r, 3)}, {"due": _DATE})
    return _obj(r, {"decisions": _arr(_str(r), 1, r.randint(3, 5)), "action_items": _arr(item, 0, 5)},
                {"next_meeting": {"anyOf": [_DATE, {"type": "null"}]}, "attendees_count": _int(1, 50)})


def _sql_args(r: random.Random) -> Schema:
    columns = r.sample(["id", "name", "email", "created_at", "total", "status", "country"], 5)
    where = _obj(r, {"column": _enum(*columns), "op": _enum("=", "<", ">", "!="),
                     "value": {"anyOf": [_str(r), {"type": "number"}]}})
    return _obj(r, {"table": _enum("users", "orders", "invoices"), "columns": _arr(_enum(*columns), 1, 4),
                    "limit": _int(1, 1000)}, {"where": _nullable(r, where), "order_desc": _BOOL})


def _recipe(r: random.Random) -> Schema:
    ingredient = _obj(r, {"item": _str(r), "amount": _num(0, 1000), "unit": _enum("g", "ml", "cup", "tbsp", "piece")})
    return _obj(r, {"name": _str(r, 3), "servings": _int(1, 12), "ingredients": _arr(ingredient, 1, r.randint(6, 12))},
                {"steps": _arr(_str(r, 3), 1, 8), "vegetarian": _BOOL})


_TEMPLATES: list[tuple[str, str, Callable[[random.Random], Schema]]] = [
    ("WeatherReport", "A weather report for one city and day.", _weather),
    ("SupportTicket", "A support ticket filed from a user's message.", _ticket),
    ("Plan", "A plan with numbered steps to reach the goal.", _plan),
    ("SearchArgs", "Arguments for the web_search tool.", _search_args),
    ("CalendarEvent", "A calendar event to create.", _event),
    ("Order", "A customer order with its line items and addresses.", _order),
    ("CodeReview", "A code review of one file.", _review),
    ("UserProfile", "A user profile with preferences.", _profile),
    ("Classification", "A classification of the customer's message.", _classify),
    ("AgentAction", "The agent's next action.", _agent_action),
    ("Contact", "A contact card extracted from an email signature.", _contact),
    ("MeetingSummary", "A summary of the meeting's decisions and action items.", _meeting),
    ("SqlQueryArgs", "Arguments for the run_sql tool.", _sql_args),
    ("Recipe", "A recipe with ingredients and steps.", _recipe),
]


def seeded_schemas(n: int = 50, seed: int = 0) -> list[Schema]:
    """`n` distinct schemas, the same for the same seed; templates in turn, varied by the seed."""
    schemas: list[Schema] = []
    seen: set[str] = set()
    attempt = 0
    while len(schemas) < n:
        title, description, build = _TEMPLATES[len(schemas) % len(_TEMPLATES)]
        schema = {"title": title, "description": description, **build(random.Random(f"{seed}:{attempt}"))}
        attempt += 1
        key = json.dumps(schema, sort_keys=True)
        if key not in seen:
            seen.add(key)
            schemas.append(schema)
    return schemas


def prompt_for(schema: Schema) -> str:
    """A short user instruction asking for an object of this schema (the bench's chat prompt)."""
    fields = list(schema.get("properties", {}))
    for branch in schema.get("oneOf", []) + schema.get("anyOf", []):
        fields += [f for f in branch.get("properties", {}) if f not in fields]
    listed = f" with the fields {', '.join(fields)}" if fields else ""
    return f"{schema.get('description', 'An object.')} Reply with only a JSON object{listed}."


def example_instance(schema: Schema, full: bool = False, *, name: str = "value", root: Schema | None = None) -> Any:
    """A valid instance: required properties only, or with `full` every declared one too.

    Picks the first non-null branch of anyOf/oneOf, the first enum value, a pattern's
    `examples[0]`, mid-range numbers and strings made of the property's name.
    """
    root = schema if root is None else root
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return example_instance(target, full, name=name, root=root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    if "examples" in schema:
        return schema["examples"][0]
    for key in ("oneOf", "anyOf"):
        if key in schema:
            branches = [b for b in schema[key] if b.get("type") != "null"] or schema[key]
            rest = {k: v for k, v in schema.items() if k != key}
            return example_instance({**rest, **branches[0]}, full, name=name, root=root)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((t for t in kind if t != "null"), "null")
    if kind == "object":
        required = schema.get("required", [])
        return {k: example_instance(v, full, name=k, root=root)
                for k, v in schema.get("properties", {}).items() if full or k in required}
    if kind == "array":
        count = schema.get("minItems", 0)
        if full:
            count = max(count, min(2, schema.get("maxItems", 2)))
        return [example_instance(schema.get("items", {}), full, name=name, root=root) for _ in range(count)]
    if kind == "string":
        fmt = schema.get("format")
        if fmt in ("date", "email"):
            return "2024-05-17" if fmt == "date" else "ana@example.com"
        words = name.replace("_", " ")
        text = (words + " ") * (schema.get("minLength", 0) // (len(words) + 1) + 1)
        return text[:max(schema.get("minLength", 0), min(len(words), schema.get("maxLength", len(words))))]
    if kind in ("integer", "number"):
        lo = schema.get("minimum", 0)
        hi = schema.get("maximum", lo + 100)
        return (lo + hi) // 2 if kind == "integer" else round(lo + (hi - lo) * 0.375, 2)
    if kind == "boolean":
        return True
    return None
