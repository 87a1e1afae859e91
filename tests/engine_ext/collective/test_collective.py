"""Collective reuse of an All-Gather round through LLMEngine on a tiny 4-layer model."""

from __future__ import annotations

import pytest
import torch

from engine_ext.collective import GroupMember
from engine_ext.config import CollectiveConfig
from tests.engine_ext.collective.round_support import GREEDY, Round, engine, run_all


@pytest.fixture(scope="module")
def deep_llama(tiny_model_dir):
    return tiny_model_dir("llama", num_hidden_layers=4)


def _layer_kv(eng, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(k.index_select(0, slots).clone(), v.index_select(0, slots).clone()) for k, v in eng.kv_cache.layers]


def _admit(eng, seqs) -> list[GroupMember]:
    """Schedule the queued round (which groups it) and return its members, probe first."""
    eng.scheduler.schedule()
    group = seqs[0].group
    assert group is not None and len(group.members) == len(seqs)
    return [GroupMember(s.request_id, s.assembly, s.token_ids, eng.kv.slots(s, s.num_tokens)) for s in group.members]


def test_collective_equals_per_request_for_the_same_positions(deep_llama):
    eng = engine(deep_llama, blend_ratio=0.3)
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    members = _admit(eng, rnd.add(eng))
    prefill = eng.runner.collective

    together = prefill.run("round-1", members)
    assert together.plan.num_selected > 0
    kv_together = [_layer_kv(eng, m.slots) for m in members]
    for i, member in enumerate(members):
        alone = prefill.run("round-1", [member], selected=together.plan.selected)
        torch.testing.assert_close(alone.last_hidden[0], together.last_hidden[i], rtol=1e-5, atol=1e-5)
        for (k1, v1), (k2, v2) in zip(kv_together[i], _layer_kv(eng, member.slots)):
            torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)
        assert alone.plan.deviations[0] == pytest.approx(together.plan.deviations[i], rel=1e-4)


def test_every_member_recomputes_the_same_offsets_in_whole_blocks(deep_llama):
    eng = engine(deep_llama, blend_ratio=0.2, collective=CollectiveConfig(diff_block_tokens=8))
    rnd = Round.make(num_agents=3, output_len=48)
    rnd.cache_outputs(eng)
    members = _admit(eng, rnd.add(eng))
    plan = eng.runner.collective.run("round-1", members).plan
    budget = sum(-(-len(o) * 2 // 10) for o in rnd.outputs)  # ceil(0.2 * n) per output
    assert plan.num_selected == budget and plan.num_candidates == sum(len(o) for o in rnd.outputs)
    offsets = torch.cat(list(plan.selected.values()))
    blocks = torch.cat([torch.unique(o // 8) for o in plan.selected.values()])
    assert blocks.numel() <= -(-budget // 8) + 1  # whole blocks, the last one trimmed
    assert offsets.numel() == budget
    assert plan.master == min(range(3), key=lambda i: plan.deviations[i])


def test_round_requests_prefill_together_and_report_it(deep_llama):
    eng = engine(deep_llama)
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    seqs = rnd.add(eng)
    run_all(eng)
    assert eng.collector.num_groups == 1 and eng.collector.num_grouped == 3
    masters = set()
    for seq in seqs:
        assert len(seq.reuse_outcomes) == 3
        for outcome in seq.reuse_outcomes:
            assert outcome.method == "blend" and outcome.collective["group_size"] == 3
            masters.add(outcome.collective["master"])
        reused = sum(o.num_reused for o in seq.reuse_outcomes)
        assert seq.num_cached_tokens == reused > 0
    assert len(masters) == 1
    assert sum(o.collective["is_master"] for s in seqs for o in s.reuse_outcomes[:1]) == 1
    # One batched copy placed every member's segments: each timeline has it, inside its prefill.
    placements = [seq.timeline.assembly["collective"] for seq in seqs]
    assert all(len(p) == 1 for p in placements) and len({p[0][:2] for p in placements}) == 1
    for seq, (placed,) in zip(seqs, placements):
        assert placed.num_tokens == sum(len(out) for out in rnd.outputs)
        assert seq.timeline.stages()["prefill"].holds(placed)


def test_a_round_whose_agents_read_the_others_but_not_themselves_is_one_group(deep_llama, monkeypatch):
    """All-Gather without self: no member holds every segment, so no one probe covers
    the round; a second deviation pass (over a member holding the probe's own output)
    covers the rest, and every member of the round prefills in the one group."""
    eng = engine(deep_llama)
    rnd = Round.make(num_agents=4)
    rnd.cache_outputs(eng)
    prefill = eng.runner.collective
    passes = []
    select = prefill._select
    monkeypatch.setattr(prefill, "_select", lambda probe: passes.append(probe.request_id) or select(probe))
    seqs = rnd.add(eng, without_self=True)
    run_all(eng)
    assert eng.collector.num_groups == 1 and eng.collector.num_grouped == 4
    assert len(passes) == 2
    for seq in seqs:
        assert len(seq.reuse_outcomes) == 3
        assert all(o.method == "blend" and o.collective["group_size"] == 4 for o in seq.reuse_outcomes)
    selection = prefill.selections["round-1"]  # every output was scored by some pass
    assert set(selection) == {eng.segment_index.peek(out).key for out in rnd.outputs}
    assert sum(o.numel() for o in selection.values()) > 0


def test_a_round_blend_would_recompute_whole_is_computed_densely(deep_llama):
    """blend_ratio 1.0 recomputes every token and runs the check layers on top: more
    than computing them, so the cost model refuses the placement, no round group forms,
    and the answers are the dense ones."""
    eng = engine(deep_llama, blend_ratio=1.0)
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    seqs = rnd.add(eng)
    run_all(eng)
    assert eng.collector.num_groups == 0
    for i, seq in enumerate(seqs):
        assert all(o.method in ("dense", "prefix") for o in seq.reuse_outcomes)
        assert any("would compute as many tokens" in (o.reason or "") for o in seq.reuse_outcomes)
        dense = eng.generate(rnd.prompt(i)[0], GREEDY, publish=False, record_logits=True)
        torch.testing.assert_close(seq.logits[0], dense.logits[0], rtol=1e-4, atol=1e-4)


def test_incompatible_requests_fall_back_to_the_single_request_path(deep_llama):
    eng = engine(deep_llama)
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    seqs = rnd.add(eng, agents=[0, 1]) + rnd.add(eng, method="shift", agents=[2])
    run_all(eng)
    assert eng.collector.num_grouped == 2
    assert all(o.collective is not None for s in seqs[:2] for o in s.reuse_outcomes)
    assert all(o.collective is None and o.method == "shift" for o in seqs[2].reuse_outcomes)


def test_requests_without_a_round_are_never_grouped(deep_llama):
    eng = engine(deep_llama)
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    seqs = rnd.add(eng, round_id=None)
    run_all(eng)
    assert eng.collector.num_groups == 0
    assert all(o.collective is None for s in seqs for o in s.reuse_outcomes)


def test_collective_off_runs_every_request_alone(deep_llama):
    eng = engine(deep_llama, collective=CollectiveConfig(enabled=False))
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    seqs = rnd.add(eng)
    run_all(eng)
    assert eng.collector is None and eng.diff_store is None
    assert all(o.collective is None and o.method == "blend" for s in seqs for o in s.reuse_outcomes)


def test_an_evicted_output_is_computed_densely_and_the_rest_still_grouped(deep_llama):
    eng = engine(deep_llama)
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    gone = eng.segment_index.lookup(rnd.outputs[1])
    eng.segment_index.blobs.discard(gone.blob)  # as if the LRU had evicted it
    seqs = rnd.add(eng)
    run_all(eng)
    assert eng.collector.num_grouped == 3
    for seq in seqs:
        by_name = {o.segment.name: o for o in seq.reuse_outcomes}
        assert by_name["agent_1_current"].method == "dense" and "evicted" in by_name["agent_1_current"].reason
        assert by_name["agent_0_current"].collective is not None
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks  # nothing left pinned


def test_a_late_member_reuses_its_rounds_selection_and_joins_its_storage(deep_llama):
    eng = engine(deep_llama)
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    early = rnd.add(eng, agents=[0, 1], publish=True)
    run_all(eng)
    late = rnd.add(eng, agents=[2], publish=True)  # same round id, after the group ran
    passes = []
    probe = eng.runner.collective._select
    eng.runner.collective._select = lambda member: passes.append(member) or probe(member)
    run_all(eng)
    assert passes == []  # no deviation pass: the round's selection is reused
    recomputed = {o.segment.name: o.num_recomputed for o in early[0].reuse_outcomes}
    assert {o.segment.name: o.num_recomputed for o in late[0].reuse_outcomes} == recomputed
    report = late[0].reuse_outcomes[0].collective
    assert report["group_size"] == 1 and report["selection"] == "round" and "master" not in report
    stats = eng.diff_store.stats()
    assert (stats["masters"], stats["mirrors"]) == (1, 2)  # found the round's master by similarity


def test_requests_that_may_not_publish_leave_no_round_cache(deep_llama):
    eng = engine(deep_llama)
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    rnd.add(eng)  # publish=False, as the fidelity harness and benchmarks send them
    run_all(eng)
    assert eng.collector.num_groups == 1
    assert eng.diff_store.stats()["masters"] == 0


def test_a_late_member_is_never_held_for_a_round_that_already_ran(deep_llama):
    eng = engine(deep_llama, collective=CollectiveConfig(window_ms=10_000))
    rnd = Round.make(num_agents=3)
    rnd.cache_outputs(eng)
    early = rnd.add(eng, agents=[0, 1], size=3)
    eng.step()
    assert eng.last_step_empty  # 2 of the 3 expected requests: held within the window
    rnd.add(eng, agents=[2], size=3)
    run_all(eng)
    assert all(s.reuse_outcomes for s in early) and eng.collector.num_groups == 1
    late = rnd.add(eng, agents=[2], size=3)  # the round ran: a late member runs at once
    eng.step()
    assert not eng.last_step_empty and late[0].reuse_outcomes is not None
