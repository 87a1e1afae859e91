"""PagedKV and ModelBridge on a tiny seeded Llama, vLLM-free: vLLM's two cache layouts
round-trip, a claim with nothing placed (or placed where it was computed) reproduces
dense prefill bit for bit, blend at ratio 1 recomputes everything, a shift is an
approximation that lands near dense, and a cache the bridge cannot read turns it off."""

from __future__ import annotations

import pytest
import torch

from engine_ext.config import ModelConfig
from engine_ext.model.attention import AttentionMetadata
from engine_ext.model.loader import load_model
from engine_ext.vllm.bridge import LayoutMismatch, ModelBridge, SegmentKV
from engine_ext.vllm.paged import PagedKV
from engine_ext.vllm.segment_plan import PlacedSpan, ReuseJob

BLOCK = 8
NUM_BLOCKS = 12


def paged_layers(layout: str, cfg: ModelConfig) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)  # garbage where nothing was written
    if layout == "cpu":
        shape = (NUM_BLOCKS, cfg.num_kv_heads, BLOCK, 2 * cfg.head_dim)
    else:
        shape = (2, NUM_BLOCKS, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return [torch.randn(shape, generator=gen) for _ in range(cfg.num_layers)]


@pytest.fixture(scope="module")
def model(llama_dir):
    return load_model(llama_dir, ModelConfig.from_dir(llama_dir))


def dense_kv(model, token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    cfg, n = model.config, len(token_ids)
    caches = [(torch.zeros(n, cfg.num_kv_heads, cfg.head_dim), torch.zeros(n, cfg.num_kv_heads, cfg.head_dim))
              for _ in range(cfg.num_layers)]
    slots = torch.arange(n)
    model(torch.tensor(token_ids), slots, caches, AttentionMetadata.build(slots, [(n, slots)], []))
    return caches


def store(paged: PagedKV, block_ids: list[int], caches, start: int, end: int) -> None:
    for layer, (k, v) in enumerate(caches):
        paged.write(layer, block_ids, start, k[start:end], v[start:end])


@pytest.mark.parametrize("layout", ["cpu", "gpu"])
def test_paged_writes_land_where_reads_find_them_and_leave_neighbours(layout, model):
    cfg = model.config
    paged = PagedKV(paged_layers(layout, cfg), NUM_BLOCKS, cfg.num_kv_heads, cfg.head_dim)
    assert paged.layout == layout and paged.block_size == BLOCK
    blocks = [5, 2, 9]
    before_k, before_v = paged.read(0, blocks, 0, 24)
    k = torch.randn(7, cfg.num_kv_heads, cfg.head_dim)
    v = torch.randn(7, cfg.num_kv_heads, cfg.head_dim)
    paged.write(0, blocks, 6, k, v)  # across the first two blocks
    after_k, after_v = paged.read(0, blocks, 0, 24)
    assert torch.equal(after_k[6:13], k) and torch.equal(after_v[6:13], v)
    assert torch.equal(after_k[:6], before_k[:6]) and torch.equal(after_k[13:], before_k[13:])
    assert torch.equal(after_v[13:], before_v[13:])
    with pytest.raises(ValueError, match="not within 3 blocks"):
        paged.read(0, blocks, 20, 25)
    with pytest.raises(ValueError, match="unknown KV cache layout"):
        PagedKV([torch.zeros(3, 4)], NUM_BLOCKS, cfg.num_kv_heads, cfg.head_dim)


def test_the_cpu_layout_keeps_each_block_s_keys_transposed(model):
    """What vLLM's CPU kernels store (checked against a real replica in tests/gateway/vllm):
    per block and head, keys (head_dim, block) then values (block, head_dim)."""
    cfg = model.config
    layers = paged_layers("cpu", cfg)
    paged = PagedKV(layers, NUM_BLOCKS, cfg.num_kv_heads, cfg.head_dim)
    k = torch.randn(BLOCK, cfg.num_kv_heads, cfg.head_dim)
    v = torch.randn(BLOCK, cfg.num_kv_heads, cfg.head_dim)
    paged.write(0, [3], 0, k, v)
    raw = layers[0][3].reshape(cfg.num_kv_heads, 2, BLOCK * cfg.head_dim)  # (H, 2, bs * D)
    assert torch.equal(raw[1, 0].view(cfg.head_dim, BLOCK), k[:, 1].T)
    assert torch.equal(raw[1, 1].view(BLOCK, cfg.head_dim), v[:, 1])


@pytest.mark.parametrize("layout", ["cpu", "gpu"])
def test_a_claim_with_nothing_moved_reproduces_dense_prefill(layout, model):
    cfg = model.config
    tokens = [(i * 7 + 3) % 90 + 5 for i in range(40)]
    dense = dense_kv(model, tokens)
    paged = PagedKV(paged_layers(layout, cfg), NUM_BLOCKS, cfg.num_kv_heads, cfg.head_dim)
    blocks = [4, 0, 7, 1, 10, 2]
    store(paged, blocks, dense, 0, 16)  # what vLLM holds: two blocks
    bridge = ModelBridge(model, paged)
    bridge.check_layout(tokens[:16], blocks)
    # Positions 20..30 placed from this very prompt's KV (where it was computed), the rest computed.
    seg = SegmentKV(torch.stack([k[20:30] for k, _ in dense]), torch.stack([v[20:30] for _, v in dense]), 20)
    job = ReuseJob("r", blocks, tokens[:36], 16, 36, [PlacedSpan(20, 30, b"k", 20)], 0.0, 1)
    bridge.run(job, [seg])
    for layer, (k, v) in enumerate(dense):
        got_k, got_v = paged.read(layer, blocks, 0, 36)
        torch.testing.assert_close(got_k, k[:36], rtol=0, atol=1e-5)
        torch.testing.assert_close(got_v, v[:36], rtol=0, atol=1e-5)


def test_a_shifted_segment_is_near_dense_and_blend_at_ratio_one_is_dense(model):
    cfg = model.config
    quoted = [(i * 11 + 1) % 90 + 5 for i in range(12)]
    source = [9, 8, 7] + quoted  # where the answer was first computed: position 3
    prompt = [(i * 5 + 2) % 90 + 5 for i in range(14)] + quoted + [6, 6, 6, 6]  # quoted at 14..26
    first = dense_kv(model, source)
    seg = SegmentKV(torch.stack([k[3:] for k, _ in first]), torch.stack([v[3:] for _, v in first]), 3)
    dense = dense_kv(model, prompt)
    errors = {}
    for ratio in (0.0, 1.0):
        paged = PagedKV(paged_layers("gpu", cfg), NUM_BLOCKS, cfg.num_kv_heads, cfg.head_dim)
        blocks = list(range(1, 5))
        store(paged, blocks, dense, 0, 8)
        job = ReuseJob("r", blocks, prompt[:26], 8, 26, [PlacedSpan(14, 26, b"k", 3)], ratio, 1)
        ModelBridge(model, paged).run(job, [seg])
        got = paged.read(cfg.num_layers - 1, blocks, 0, 26)[0]
        errors[ratio] = (got - dense[-1][0][:26]).abs().max().item()
        if ratio == 0.0:  # layer 0 of a shifted key is exact: it depends on the token and position only
            torch.testing.assert_close(paged.read(0, blocks, 14, 26)[0], dense[0][0][14:26], rtol=0, atol=1e-4)
    assert errors[1.0] < 1e-4 < errors[0.0]


def test_a_cache_the_bridge_cannot_read_is_refused(model):
    cfg = model.config
    paged = PagedKV(paged_layers("cpu", cfg), NUM_BLOCKS, cfg.num_kv_heads, cfg.head_dim)  # never written
    with pytest.raises(LayoutMismatch, match="layer 0 of vLLM's cache differs"):
        ModelBridge(model, paged).check_layout([5, 6, 7, 8, 9], [0])


def test_layer_0_of_any_computed_span_checks_the_layout(model):
    """A span vLLM computed anywhere (an answer at position 20) checks the layout as well as
    a prompt's first tokens: layer 0 depends on each token and its position alone."""
    cfg = model.config
    tokens = [(i * 3 + 1) % 90 + 5 for i in range(32)]
    dense = dense_kv(model, tokens)
    bridge = ModelBridge(model, PagedKV(paged_layers("gpu", cfg), NUM_BLOCKS, cfg.num_kv_heads, cfg.head_dim))
    bridge.check_layer0(tokens[20:30], 20, dense[0][0][20:30], dense[0][1][20:30])
    assert bridge.checked
    with pytest.raises(LayoutMismatch):
        bridge.check_layer0(tokens[20:30], 19, dense[0][0][20:30], dense[0][1][20:30])  # one position off
