"""A trace-driven model of routing across many replicas (`kvrelay bench cluster`'s simulator).

Two one-core replicas are all this machine can run; the question the policies answer is
what happens at 8, 16 or 64. This replays the same captured sessions, with the prompts a
real replay rendered (tokenized by the model's own chat template, hashed into the
engine's 16-token blocks) and the answer lengths it measured, against simulated replicas:

- the router is the gateway's: the same policy classes (kvrelay/gateway/routing/policies.py),
  the same prefix keys, the same CacheMap fed by the same reports (every `poll_s`) and
  the same learning from each response's blocks; only the upstreams are simulated;
- a replica is one core running the engine's steps: a step takes one token of every
  decoding sequence, then prompt tokens (first come, first served) up to
  `step_tokens` in all (the engine's `max_num_batched_tokens`), and costs `step_s` +
  `prefill_s_per_token` x its prompt tokens + `step_s_per_seq` x its sequences; those
  costs are measured on this machine (`calibrate`), and scaled by one factor fitted to
  a real replay (`Costs.scaled`: the gateway, the client and the HTTP path share the
  cores in a real run, which an engine measured alone does not see);
- a replica's cache is an LRU of blocks holding its device tier and the host tier the
  engine sizes by default (twice the device tier); a prompt computes the part after the
  longest run of its blocks there, counted when its prefill starts; the blocks of the
  requests it is running take device room first.

A request opted into an approximate method (the long family's KVCOMM) also places
texts (`SimText`: a shared passage, an earlier agent's answer) that its replica holds:
a replica holds a text once a prompt holding it was prefilled there (KVCOMM's default
serves an answer's KV from its first reader, not from the request that wrote it). A
text's copies take room of their own beside the prompt's blocks, in the same LRU, and
on the device only (the engine keeps segment KV in blocks of its device pool; its host
tier backs up prefix blocks): one for a shared block, `ANCHOR_COPIES` for a KVCOMM
placeholder (the anchor's base and offsets beside the index's copy). A held text counts
as cached where it lies past the prefix hit and costs `placed_share` of computing it;
a prompt that placed a text leaves no block cached from that text on (placed KV is
approximate, and the engine does not publish it). The router weighs held texts through
the gateway's own SegmentMap.

Sessions are closed loops as in the real replay: `concurrency` sessions at once, a
request sent when the requests it waited for in the capture have ended. For more
replicas than sessions captured, each session is copied; a copy shares its first
message (the app's fixed system prompt) with the original and nothing after it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import itertools
import math
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.agents.replay import Key, Outcome
from benchmarks.agents.workload import Run
from engine_ext.config import EngineConfig
from kvrelay.gateway.routing.cache_map import CacheMap
from kvrelay.gateway.routing.policies import RoutingPolicy, SessionHomes, build_policy, held_tokens, plan_route
from kvrelay.gateway.routing.prefix_keys import PrefixKey, prefix_keys
from kvrelay.gateway.routing.segment_map import PlacedText, SegmentMap
from kvrelay.gateway.settings import GatewaySettings, RoutingSettings
from engine_ext.tiers.sizing import DEVICE_MULTIPLE
from kvrelay.wire.cache_report import CacheReport, digests

BLOCK_SIZE = 16  # the embedded engine's
HOST_MULTIPLE = DEVICE_MULTIPLE  # the engine's default host tier, in device tiers
# A KVCOMM placeholder's first reader computes it and measures it: the segment index's
# copy, the anchor's base copy and that reader's offsets, each as large as the text
# (engine_ext/kvcomm/bank.py). A shared block is placed by the RoPE shift alone: one copy.
ANCHOR_COPIES = 3


@dataclass(frozen=True)
class Costs:
    """What an engine step costs on one core (seconds)."""

    prefill_s_per_token: float
    step_s: float
    step_s_per_seq: float
    step_tokens: int = EngineConfig.max_num_batched_tokens
    poll_s: float = 0.5  # how often the gateway reads each replica's blocks
    # A placed token costs this share of a computed one (the embedded engine, KVCOMM on
    # 2 cores: 0.10-0.15 ms against 2.4-2.5 ms, docs/engine.md).
    placed_share: float = 0.05

    def scaled(self, factor: float) -> Costs:
        """Every time `factor` x as long."""
        return dataclasses.replace(self, prefill_s_per_token=self.prefill_s_per_token * factor,
                                   step_s=self.step_s * factor, step_s_per_seq=self.step_s_per_seq * factor)


class SimText(NamedTuple):
    """A text an opted-in request would place (a plan's placeholder or shared block)."""

    key: str  # its content hash
    start: int  # its first token's position in the prompt
    tokens: int
    source: int | None = None  # the session's request whose answer it is
    anchored: bool = False  # a KVCOMM placeholder: measured where first computed (ANCHOR_COPIES)


@dataclass(frozen=True)
class SimRequest:
    index: int  # within its session
    waits_for: tuple[int, ...]  # indices of the session's requests it is sent after
    keys: tuple[PrefixKey, ...]  # the gateway's prefix keys of its prompt
    blocks: tuple[bytes, ...]  # the hashes of its prompt's full blocks
    shared_blocks: int  # of those, the first message's (what a copy of its session shares)
    prompt_tokens: int
    output_tokens: int
    placed: tuple[SimText, ...] = ()  # opted in: the texts it would place where held


@dataclass(frozen=True)
class SimSession:
    name: str
    requests: tuple[SimRequest, ...]


PlacedOf = Callable[[Outcome, dict[str, int]], tuple[SimText, ...]]  # (outcome, its session's request ids) -> texts


def build_trace(runs: Sequence[Run], outcomes: dict[Key, Outcome], encode: Callable[[dict[str, Any]], list[int]],
                first_message_tokens: Callable[[dict[str, Any]], int],
                placed_of: PlacedOf | None = None) -> list[SimSession]:
    """The sessions of `runs` as the real replay sent them: `outcomes` holds each
    request's rendered prompt and measured answer length; `encode` tokenizes a body's
    prompt, `first_message_tokens` the part a copy shares (see `copies`); `placed_of`,
    for opted-in traffic, the texts a request's plan would place (given the gateway's
    request ids of its session's requests, by index)."""
    sessions = []
    for run in runs:
        index = {r.seq: i for i, r in enumerate(run.requests)}
        ids_of = {o.request_id: i for i, r in enumerate(run.requests)
                  if (o := outcomes[r.key]).request_id is not None}
        requests = []
        for i, request in enumerate(run.requests):
            outcome = outcomes[request.key]
            ids = encode(outcome.body)
            blocks = _block_hashes(ids)
            requests.append(SimRequest(
                i, tuple(index[r.seq] for r in run.waits_for(request)), tuple(prefix_keys(outcome.body, None)),
                blocks, min(first_message_tokens(outcome.body) // BLOCK_SIZE, len(blocks)), len(ids),
                max(outcome.completion_tokens, 1), placed_of(outcome, ids_of) if placed_of else ()))
        sessions.append(SimSession("/".join(run.key), tuple(requests)))
    return sessions


def _block_hashes(ids: list[int]) -> tuple[bytes, ...]:
    """Chained hashes of the prompt's full blocks: equal only where the prefixes are equal."""
    out, parent = [], b""
    for start in range(0, len(ids) - len(ids) % BLOCK_SIZE, BLOCK_SIZE):
        data = b"".join(t.to_bytes(4, "little") for t in ids[start:start + BLOCK_SIZE])
        parent = hashlib.blake2b(parent + data, digest_size=16).digest()
        out.append(parent)
    return tuple(out)


def copies(sessions: list[SimSession], count: int) -> list[SimSession]:
    """`count` sessions from the captured ones, round-robin; copy c > 0 shares its
    prompts' first message (keys and blocks) with the original and nothing after it."""
    out = []
    for c in range(count):
        base = sessions[c % len(sessions)]
        salt = c // len(sessions)
        out.append(base if salt == 0 else SimSession(f"{base.name}#{salt}", tuple(
            _salted(r, salt) for r in base.requests)))
    return out


def _salted(request: SimRequest, salt: int) -> SimRequest:
    tag = salt.to_bytes(4, "big")
    keys = request.keys[:1] + tuple(PrefixKey(hashlib.blake2b(k.key + tag, digest_size=16).digest(), k.chars)
                                    for k in request.keys[1:])
    shared = request.shared_blocks
    blocks = request.blocks[:shared] + tuple(hashlib.blake2b(b + tag, digest_size=16).digest()
                                             for b in request.blocks[shared:])
    placed = tuple(t._replace(key=hashlib.blake2b(t.key.encode() + tag, digest_size=32).hexdigest())
                   for t in request.placed)
    return dataclasses.replace(request, keys=keys, blocks=blocks, placed=placed)


@dataclass
class _Job:
    session: int
    request: SimRequest
    arrived: float
    todo: int = -1  # prompt tokens left to compute; -1 until its prefill starts
    published: int = 0  # of its prompt's blocks, those the engine caches (set when its prefill starts)
    decoded: int = 0
    occupancy: int = 0  # what it added to the replica's in_flight_tokens
    first_token: float | None = None


@dataclass
class SimReplica:
    """A replica as the router sees it (`url`, `in_flight`, `in_flight_tokens`) and as
    the model runs it (a queue of prefills, a batch of decodes, an LRU of blocks)."""

    url: str
    device_blocks: int
    in_flight: int = 0
    in_flight_tokens: int = 0
    busy: bool = False
    prefilling: deque[_Job] = field(default_factory=deque)
    decoding: list[_Job] = field(default_factory=list)
    # One LRU: a block's hash (room 1), or a placeable text's key (room: its blocks).
    cache: OrderedDict[bytes | str, int] = field(default_factory=OrderedDict)
    used: int = 0  # the room the cache takes, in blocks
    text_used: int = 0  # of which, the texts' (device only)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def start_prefill(self, job: _Job, placed_share: float) -> None:
        hit = 0
        for block in job.request.blocks:
            if block not in self.cache:
                break
            self.cache.move_to_end(block)
            hit += 1
        # Texts past the prefix hit are placed where held; the rest is computed.
        placed = 0
        job.published = len(job.request.blocks)
        for text in job.request.placed:
            if text.start >= hit * BLOCK_SIZE and text.key in self.cache:
                self.cache.move_to_end(text.key)
                placed += text.tokens
                # Placed KV is approximate: no block from the first placed token on is cached.
                job.published = min(job.published, text.start // BLOCK_SIZE)
        # The last prompt token is always computed (its logits give the first token).
        cached = min(hit * BLOCK_SIZE + placed, job.request.prompt_tokens - 1)
        job.todo = job.request.prompt_tokens - cached + math.ceil(placed_share * max(cached - hit * BLOCK_SIZE, 0))
        self.prompt_tokens += job.request.prompt_tokens
        self.cached_tokens += cached

    def keep(self, job: _Job) -> None:
        request = job.request
        entries = [(block, 1) for block in request.blocks[:job.published]]
        entries += [(text.key, -(-text.tokens // BLOCK_SIZE) * (ANCHOR_COPIES if text.anchored else 1))
                    for text in request.placed]
        for key, room in entries:
            grown = room - self.cache.get(key, 0)
            self.used += grown
            self.text_used += grown if isinstance(key, str) else 0
            self.cache[key] = room
            self.cache.move_to_end(key)
        # The running requests' blocks take device room; the host tier holds only cached ones.
        running = sum(len(j.request.blocks) for j in (*self.prefilling, *self.decoding))
        device = max(self.device_blocks - running, 0)
        while self.used > self.device_blocks * HOST_MULTIPLE + device:
            self._evict(next(iter(self.cache)))
        while self.text_used > device:
            self._evict(next(k for k in self.cache if isinstance(k, str)))

    def _evict(self, key: bytes | str) -> None:
        room = self.cache.pop(key)
        self.used -= room
        self.text_used -= room if isinstance(key, str) else 0

    def blocks(self) -> list[bytes]:
        return [key for key in self.cache if isinstance(key, bytes)]


@dataclass(frozen=True)
class SimResult:
    ttft_s: list[float]
    prompt_tokens: int
    cached_tokens: int

    @property
    def ttft_p50_ms(self) -> float:
        return statistics.median(self.ttft_s) * 1000

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Simulation:
    """One replay of `sessions` over `num_replicas` simulated replicas routed by `policy`."""

    def __init__(self, costs: Costs, num_replicas: int, device_blocks: int, policy: str, concurrency: int) -> None:
        self.costs = costs
        self.replicas = [SimReplica(f"http://replica-{i}", device_blocks) for i in range(num_replicas)]
        self.cache_map = CacheMap()  # the gateway's view of every replica
        self.segment_map = SegmentMap()  # and of the texts opted-in requests place
        self.homes = SessionHomes()
        # Built as the gateway builds it, with the gateway's defaults.
        load_guard_factor = GatewaySettings.model_fields["load_guard_factor"].default
        self.settings = RoutingSettings(policy=policy)
        self.policy: RoutingPolicy = build_policy(self.settings, self.homes, load_guard_factor, self.cache_map,
                                                  self.segment_map)
        self.concurrency = concurrency
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.now = 0.0

    def run(self, sessions: list[SimSession]) -> SimResult:
        self._sessions = sessions
        self._waiting = deque(range(len(sessions)))
        self._done: list[set[int]] = [set() for _ in sessions]
        self._sent: list[set[int]] = [set() for _ in sessions]
        self._ttft: list[float] = []
        self._remaining = sum(len(s.requests) for s in sessions)
        for _ in range(min(self.concurrency, len(sessions))):
            self._start_session()
        self._at(0.0, self._poll)
        while self._remaining and self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
        return SimResult(self._ttft, sum(r.prompt_tokens for r in self.replicas),
                         sum(r.cached_tokens for r in self.replicas))

    # -- sessions and the router -------------------------------------------------------
    def _start_session(self) -> None:
        if self._waiting:
            self._send_ready(self._waiting.popleft())

    def _send_ready(self, session: int) -> None:
        done, sent = self._done[session], self._sent[session]
        for request in self._sessions[session].requests:
            if request.index not in sent and all(w in done for w in request.waits_for):
                sent.add(request.index)
                self._route(_Job(session, request, self.now))

    def _route(self, job: _Job) -> None:
        route = plan_route(job.request.keys, self.cache_map, self.policy.reads_cache)
        name = self._sessions[job.session].name
        route = route._replace(session_id=name)
        if self.policy.reads_cache and job.request.placed:  # as the gateway reads an opted-in plan
            placed = tuple(PlacedText(t.key, None if t.source is None else f"{name}/{t.source}", t.tokens)
                           for t in job.request.placed)
            route = route._replace(placed=placed, kept_request=f"{name}/{job.request.index}")
        replica = self.policy.order(route, list(self.replicas))[0]  # type: ignore[arg-type]
        assert isinstance(replica, SimReplica)
        if self.policy.reads_cache:
            self.cache_map.routed(replica.url, route.keys, route.predicted)
            self.segment_map.routed(replica.url, route.kept_request, route.placed)
        held = held_tokens(route, replica.url, self.cache_map, self.segment_map, self.settings.segment_weight)
        job.occupancy = max(route.prompt_tokens - int(held), 0)
        replica.in_flight += 1
        replica.in_flight_tokens += job.occupancy
        replica.prefilling.append(job)
        if not replica.busy:
            self._step(replica)

    def _finished(self, replica: SimReplica, job: _Job) -> None:
        replica.in_flight -= 1
        self._remaining -= 1
        self.cache_map.learn(job.request.keys, digests(job.request.blocks))
        session = self._sessions[job.session]
        self._done[job.session].add(job.request.index)
        if len(self._done[job.session]) == len(session.requests):
            self._start_session()
        else:
            self._send_ready(job.session)

    def _poll(self) -> None:
        for replica in self.replicas:
            self.cache_map.replace(replica.url, CacheReport(block_size=BLOCK_SIZE, device=digests(replica.blocks())))
        self._at(self.now + self.costs.poll_s, self._poll)

    # -- replicas ----------------------------------------------------------------------
    def _step(self, replica: SimReplica) -> None:
        """Start the replica's next step if it has work; its end is an event."""
        if not replica.prefilling and not replica.decoding:
            replica.busy = False
            return
        replica.busy = True
        budget, chunk = self.costs.step_tokens - len(replica.decoding), []
        for job in replica.prefilling:
            if budget <= 0:
                break
            if job.todo < 0:
                replica.start_prefill(job, self.costs.placed_share)
            take = min(job.todo, budget)
            chunk.append((job, take))
            budget -= take
        seqs = len(replica.decoding) + sum(1 for job, take in chunk if take == job.todo)
        cost = (self.costs.step_s + self.costs.prefill_s_per_token * sum(take for _, take in chunk)
                + self.costs.step_s_per_seq * seqs)
        self._at(self.now + cost, lambda: self._end_step(replica, chunk))

    def _end_step(self, replica: SimReplica, chunk: list[tuple[_Job, int]]) -> None:
        ended = []
        for job in replica.decoding:
            job.decoded += 1
            if job.decoded >= job.request.output_tokens:
                ended.append(job)
        replica.decoding = [j for j in replica.decoding if j not in ended]
        for job, take in chunk:
            job.todo -= take
            if job.todo == 0:
                replica.prefilling.remove(job)
                job.first_token, job.decoded = self.now, 1
                self._ttft.append(self.now - job.arrived)
                replica.in_flight_tokens -= job.occupancy
                replica.keep(job)
                (ended if job.decoded >= job.request.output_tokens else replica.decoding).append(job)
        for job in ended:
            self._finished(replica, job)
        self._step(replica)

    def _at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._order), action))


def calibrate(model_dir: Path, prompt_tokens: int = 512, batch: int = 8, repeats: int = 3) -> Costs:
    """Step costs of the embedded engine on one thread (a replica's one core), measured here:
    a prefill of `prompt_tokens` fresh tokens, and decode steps at batch 1 and `batch`."""
    import torch

    from benchmarks.engine import PromptSource, engine_decode_tps, engine_prefill
    from engine_ext.engine import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=256 * 2**20))
    try:
        prompt_tokens = min(prompt_tokens, engine.max_model_len // 2)  # a test model's context is short
        prompts = PromptSource(engine.model_config.vocab_size, seed=7)
        one = min(_seconds(lambda: engine_prefill(engine, prompts, prompt_tokens)) for _ in range(repeats))
        step_1 = 1 / engine_decode_tps(engine, prompts, 1, 64, 16)
        step_b = batch / engine_decode_tps(engine, prompts, batch, 64, 16)
    finally:
        engine.close()  # its transfer thread and its host tier, before the bench goes on
        torch.set_num_threads(threads)
    per_seq = max((step_b - step_1) / (batch - 1), 0.0)
    step = max(step_1 - per_seq, 0.0)
    return Costs(prefill_s_per_token=max(one - step - per_seq, 0.0) / prompt_tokens, step_s=step,
                 step_s_per_seq=per_seq)


def _seconds(action: Callable[[], None]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started
