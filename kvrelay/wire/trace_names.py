"""Every span and attribute name kvrelay emits, gateway and engine, in one place.

Both services follow the OpenTelemetry GenAI semantic conventions (gen_ai.*) and add
kvrelay.* names for what the conventions do not cover. A test collects the names of
a real gateway -> engine trace and checks each kvrelay.* one is listed here.

One trace per request (the engine continues the gateway's W3C traceparent):

    {operation} {model}               gateway, CLIENT: the proxied call
      {operation} {model}             engine, SERVER: the request in the engine
        kvrelay.prepare                 arrived -> queued (tokenizing, aligning the plan's segments)
        kvrelay.queue                   queued -> admitted (the engine thread, KV blocks, a batch slot)
        kvrelay.plan                    prefix match and reuse decisions
        kvrelay.prefill                 planned -> prompt computed
          kvrelay.prefill_step            a forward step that computed one of its chunks
            kvrelay.kv_assembly {method}    a KV placement inside that step
          kvrelay.kv_assembly {method}    a placement at admission (diff_restore, tier_fetch)
          event kvrelay.reuse {method}    per method: tokens reused / recomputed overall
        kvrelay.first_token             forward done -> first token sampled and handed over
        kvrelay.decode                  first token -> finished

The stages prepare, queue, plan, prefill and first_token are contiguous: their
durations add up to the engine's TTFT. A failed or abandoned request keeps the stages
it reached, the one it was in ending at the failure, with an ERROR status and error.type.

Gateway call span (kvrelay/gateway/tracing.py), beyond gen_ai.*:
- kvrelay.request.id: the gateway's request id (the SQL record's key)
- kvrelay.stream, kvrelay.status, kvrelay.upstream: how the call went and where
- kvrelay.prompt.sha256: the prompt's hash (the text itself is never an attribute)
- kvrelay.plan.version, kvrelay.plan.num_segments, kvrelay.plan.num_<kind> (per segment
  kind: fixed_prefix, placeholder, ...), kvrelay.plan.placeholders: the segment plan
- kvrelay.session.inferred: whether the session was inferred rather than given
- kvrelay.round.id, kvrelay.round.size, kvrelay.round.index: the All-Gather round

Engine request span (engine_ext/server/tracing.py), beyond gen_ai.* (its request id,
the completion's id, is gen_ai.response.id):
- kvrelay.ttft_s: the engine's TTFT; kvrelay.ttft.<stage>_s (prepare, queue, plan, prefill, first)
- kvrelay.prefill.num_steps: engine steps that computed the prompt (chunks, preemptions)
- kvrelay.prefill.compute_s: those steps' time, less the KV placements inside them
- kvrelay.prefill.wait_s: the prefill's wait between chunks (other requests' steps)

KV assembly spans and reuse events:
- kvrelay.reuse.method: shift, blend, link, kvcomm (a placed segment), collective (a
  round's batched copy), diff_restore (a stored round cache), tier_fetch (prefix blocks
  from a lower tier); on events also prefix, restored, dense
- kvrelay.reuse.tokens_placed: tokens this placement put in place (spans)
- kvrelay.reuse.tokens_reused, kvrelay.reuse.tokens_recomputed: the method's totals over
  the request's segments (events, one per method, so sums never double count)
"""

from __future__ import annotations

STAGE_SPANS = {"prepare": "kvrelay.prepare", "queue": "kvrelay.queue", "plan": "kvrelay.plan",
               "prefill": "kvrelay.prefill", "first": "kvrelay.first_token", "decode": "kvrelay.decode"}
PREFILL_STEP_SPAN = "kvrelay.prefill_step"
ASSEMBLY_SPAN = "kvrelay.kv_assembly"  # + " {method}"
REUSE_EVENT = "kvrelay.reuse"  # + " {method}"
