"""The cluster simulator: its cost model, its caches, and the gateway's policies driving it."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from benchmarks.cluster_sim import BLOCK_SIZE, Costs, SimRequest, SimSession, SimText, Simulation, copies
from kvrelay.gateway.routing.prefix_keys import PrefixKey

COSTS = Costs(prefill_s_per_token=0.001, step_s=0.01, step_s_per_seq=0.002, step_tokens=256, poll_s=0.5)


def _hashes(tag: str, n: int, parent: bytes = b"") -> tuple[bytes, ...]:
    out = []
    for i in range(n):
        parent = hashlib.blake2b(parent + f"{tag}{i}".encode(), digest_size=16).digest()
        out.append(parent)
    return tuple(out)


def _request(index: int, blocks: tuple[bytes, ...], keys: tuple[PrefixKey, ...], output: int = 4,
             waits_for: tuple[int, ...] = ()) -> SimRequest:
    return SimRequest(index, waits_for if waits_for or index == 0 else (index - 1,), keys, blocks, 1,
                      len(blocks) * BLOCK_SIZE, output)


def _session(name: str, turns: int, blocks_per_turn: int = 8, shared: tuple[bytes, ...] = ()) -> SimSession:
    """A session whose every prompt extends the last one (an agent chain)."""
    requests = []
    blocks = shared
    keys: tuple[PrefixKey, ...] = (PrefixKey(b"sys" + bytes(13), 100),)
    for i in range(turns):
        blocks = blocks + _hashes(f"{name}-{i}-", blocks_per_turn, blocks[-1] if blocks else b"")
        keys = keys + (PrefixKey(hashlib.blake2b(keys[-1].key + name.encode() + bytes([i]), digest_size=16).digest(),
                                 len(blocks) * BLOCK_SIZE * 4),)
        requests.append(_request(i, blocks, keys))
    return SimSession(name, tuple(requests))


def test_one_request_costs_its_steps() -> None:
    """A 256-token prompt is one chunk; then three decode steps of one sequence."""
    blocks = _hashes("a", 16)
    session = SimSession("s", (_request(0, blocks, (PrefixKey(b"k" * 16, 1024),)),))
    result = Simulation(COSTS, 1, 1000, "session", 1).run([session])
    first = COSTS.step_s + 256 * COSTS.prefill_s_per_token + COSTS.step_s_per_seq
    assert result.ttft_s == [pytest.approx(first)]
    assert result.prompt_tokens == 256 and result.cached_tokens == 0


def test_a_chain_reuses_its_own_prefix_and_concurrency_bounds_the_sessions() -> None:
    sessions = [_session("a", 3), _session("b", 3)]
    result = Simulation(COSTS, 1, 1000, "session", 1).run(sessions)
    # Each turn after the first finds the previous prompt (8 blocks per turn) cached.
    assert result.cached_tokens == 2 * (8 + 16) * BLOCK_SIZE
    assert len(result.ttft_s) == 6
    # One session at a time: no TTFT ever includes another request's prefill.
    assert max(result.ttft_s) < COSTS.step_s + 256 * COSTS.prefill_s_per_token + 2 * COSTS.step_s_per_seq + 1e-9


def test_a_small_cache_evicts_least_recently_used_blocks() -> None:
    sessions = [_session("a", 3)]
    result = Simulation(COSTS, 1, 4, "session", 1).run(sessions)  # 4 device + 8 host blocks
    assert result.cached_tokens < (8 + 16) * BLOCK_SIZE


@pytest.mark.parametrize("policy", ["session", "cache_aware"])
def test_cache_knowing_policies_keep_a_session_with_its_blocks(policy: str) -> None:
    # One session at a time, so no queue ever outweighs a hit; three, so round-robin's turns
    # cannot line up with a session's.
    sessions = [_session(f"s{i}", 4) for i in range(3)]
    ours = Simulation(COSTS, 2, 1000, policy, 1).run(sessions)
    spread = Simulation(COSTS, 2, 1000, "round_robin", 1).run(sessions)
    assert ours.hit_rate == pytest.approx(24 / 40)  # every turn after the first hits its whole last prompt
    assert spread.hit_rate < ours.hit_rate
    assert len(ours.ttft_s) == len(spread.ttft_s) == 12


def test_a_copy_shares_only_its_first_message() -> None:
    system = _hashes("sys", 2)
    base = _session("a", 2, shared=system)
    base = SimSession(base.name, tuple(SimRequest(r.index, r.waits_for, r.keys, r.blocks, 2, r.prompt_tokens,
                                                  r.output_tokens) for r in base.requests))
    original, copy = copies([base], 2)
    assert original is base
    for a, b in zip(original.requests, copy.requests):
        assert a.blocks[:2] == b.blocks[:2] and not set(a.blocks[2:]) & set(b.blocks[2:])
        assert a.keys[0] == b.keys[0] and not set(a.keys[1:]) & set(b.keys[1:])
        assert (a.prompt_tokens, a.output_tokens, a.waits_for) == (b.prompt_tokens, b.output_tokens, b.waits_for)


def test_a_prompt_longer_than_a_step_takes_several_and_scaling_scales_every_cost() -> None:
    session = SimSession("s", (_request(0, _hashes("a", 32), (PrefixKey(b"k" * 16, 2048),)),))
    result = Simulation(COSTS.scaled(2.0), 1, 1000, "session", 1).run([session])
    one = 2 * COSTS.step_s + 512 * COSTS.prefill_s_per_token + COSTS.step_s_per_seq  # two steps of 256
    assert result.ttft_s == [pytest.approx(2 * one)]


PASSAGE = SimText("p" * 64, start=16, tokens=400)


def _board(name: str, agents: int = 5) -> SimSession:
    """Opted-in agents in turn, each with its own one-block persona, reading one passage
    (and the answers before theirs): no prompt shares a prefix with another's."""
    requests = []
    for i in range(agents):
        answers = tuple(SimText(f"{name}-answer-{j}".ljust(64, "0"), 16 + 400 + 32 * j, 32, source=j) for j in range(i))
        tokens = 16 + 400 + 32 * i + 16
        blocks = _hashes(f"{name}-agent{i}-", tokens // BLOCK_SIZE)
        keys = (PrefixKey(hashlib.blake2b(f"{name}{i}".encode(), digest_size=16).digest(), tokens * 4),)
        requests.append(SimRequest(i, (i - 1,) if i else (), keys, blocks, 1, tokens, 4,
                                   (PASSAGE._replace(key=f"{name}-passage".ljust(64, "0")), *answers)))
    return SimSession(name, tuple(requests))


def test_a_held_text_is_placed_past_the_prefix_hit_and_only_there() -> None:
    board = _board("b", agents=2)
    result = Simulation(COSTS, 1, 1000, "session", 1).run([board])
    # Agent 2 places the passage agent 1's prompt held; agent 1's answer it reads first.
    assert result.cached_tokens == 400
    # A third prompt starting like agent 2's through the passage (26 blocks), then its own:
    # the prefix hit covers the passage, so only agent 1's answer (read once since) is placed.
    again = board.requests[1]
    blocks = again.blocks[:26] + _hashes("own-", len(again.blocks) - 26, again.blocks[25])
    covered = dataclasses.replace(again, index=2, waits_for=(1,), blocks=blocks)
    result = Simulation(COSTS, 1, 1000, "session", 1).run([SimSession("b", (*board.requests, covered))])
    assert result.cached_tokens == 400 + 26 * BLOCK_SIZE + 32  # the passage is not counted twice


def test_held_texts_share_the_lru_with_blocks() -> None:
    result = Simulation(COSTS, 1, 4, "session", 1).run([_board("b", agents=2)])  # 12 blocks in all: the passage needs 25
    assert result.cached_tokens == 0


def test_cache_aware_keeps_an_opted_in_board_where_its_texts_are_and_round_robin_spreads_it() -> None:
    boards = [_board(f"b{i}") for i in range(2)]
    ours = Simulation(COSTS, 4, 1000, "cache_aware", 1).run(boards)
    spread = Simulation(COSTS, 4, 1000, "round_robin", 1).run(boards)
    # One board at a time: agents 2-5 place the passage and every answer read before.
    read = sum(r.placed[0].tokens + 32 * (len(r.placed) - 2) for r in boards[0].requests[1:] if len(r.placed) > 1)
    assert ours.cached_tokens == 2 * read
    assert spread.hit_rate < 0.5 * ours.hit_rate  # each agent of a board on another replica


def test_a_copy_salts_its_texts() -> None:
    original, copy = copies([_board("b")], 2)
    keys = {t.key for r in original.requests for t in r.placed}
    assert keys and not keys & {t.key for r in copy.requests for t in r.placed}
    assert [t.tokens for r in original.requests for t in r.placed] == [t.tokens for r in copy.requests for t in r.placed]


def test_held_texts_live_on_the_device_only_and_cost_their_placement() -> None:
    board = [_board("b", agents=2)]
    roomy = Simulation(COSTS, 1, 30, "session", 1).run(board)  # the passage's 25 blocks fit the device
    assert roomy.cached_tokens == 400
    tight = Simulation(COSTS, 1, 20, "session", 1).run(board)  # 60 blocks in all, but 20 on the device
    assert tight.cached_tokens == 0
    free = Simulation(dataclasses.replace(COSTS, placed_share=0.0), 1, 30, "session", 1).run(board)
    # Agent 2 computes 64 tokens, and pays 5% of the 400 it places: 20 more.
    assert roomy.ttft_s[1] - free.ttft_s[1] == pytest.approx(20 * COSTS.prefill_s_per_token)


def test_an_anchored_text_takes_room_for_its_anchor_beside_its_copy() -> None:
    """A KVCOMM placeholder's first reader measures it: the anchor's base and offsets
    take ANCHOR_COPIES times the text's blocks where a shared block takes one."""
    anchored = _board("b", agents=2)
    anchored = SimSession("b", tuple(dataclasses.replace(r, placed=tuple(t._replace(anchored=True) for t in r.placed))
                                     for r in anchored.requests))
    assert Simulation(COSTS, 1, 60, "session", 1).run([_board("b", agents=2)]).cached_tokens == 400
    assert Simulation(COSTS, 1, 60, "session", 1).run([anchored]).cached_tokens == 0  # 3 x 25 blocks
    assert Simulation(COSTS, 1, 120, "session", 1).run([anchored]).cached_tokens == 400


def test_a_prompt_that_placed_a_text_caches_no_block_from_it_on() -> None:
    """Placed KV is approximate: the engine publishes a prompt's blocks only up to its
    first placed token, so a later prompt starting the same way hits only that far."""
    board = _board("b", agents=2)
    same = dataclasses.replace(board.requests[1], index=2, waits_for=(1,), placed=())
    result = Simulation(COSTS, 1, 1000, "session", 1).run([SimSession("b", (*board.requests, same))])
    assert result.cached_tokens == 400 + BLOCK_SIZE  # agent 2 placed the passage; the copy hits its persona only
    computed = dataclasses.replace(board.requests[0], index=1, waits_for=(0,), placed=())
    result = Simulation(COSTS, 1, 1000, "session", 1).run([SimSession("b", (board.requests[0], computed))])
    assert result.cached_tokens == len(computed.blocks) * BLOCK_SIZE - 1  # nothing placed: every block cached
