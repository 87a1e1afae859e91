"""engine_ext.kernels.rope against transformers' rotary embedding, and the RoPE shift property that
reuse methods rely on (a key at position p moved by d equals the key computed at p+d)."""

from __future__ import annotations

import pytest
import torch

from engine_ext.config import RopeConfig
from engine_ext.kernels.rope import apply_rotary, rope_cos_sin, rope_inv_freq

HEAD_DIM = 64

ROPES = {
    "default": RopeConfig(theta=10000.0),
    "theta_500k": RopeConfig(theta=500000.0),
    "llama3": RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=64),
    "llama3_8k": RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                            high_freq_factor=4.0, original_max_position_embeddings=8192),
    "linear": RopeConfig(theta=10000.0, rope_type="linear", factor=4.0),
}


def _hf_rotary(rope: RopeConfig):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type == "llama3":
        params.update(factor=rope.factor, low_freq_factor=rope.low_freq_factor,
                      high_freq_factor=rope.high_freq_factor,
                      original_max_position_embeddings=rope.original_max_position_embeddings)
    elif rope.rope_type == "linear":
        params.update(factor=rope.factor)
    cfg = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=16384, rope_parameters=params)
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("name", list(ROPES))
def test_inv_freq_matches_hf(name):
    ours = rope_inv_freq(ROPES[name], HEAD_DIM)
    hf = _hf_rotary(ROPES[name]).inv_freq.float()
    assert ours.dtype == torch.float32
    assert ours.shape == (HEAD_DIM // 2,)
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=0)


def test_llama3_scaling_changes_only_low_frequencies():
    base = rope_inv_freq(ROPES["theta_500k"], HEAD_DIM)
    scaled = rope_inv_freq(ROPES["llama3"], HEAD_DIM)
    assert torch.equal(scaled[0], base[0])  # highest frequency kept
    torch.testing.assert_close(scaled[-1], base[-1] / 8.0)  # lowest frequency slowed by factor
    assert (scaled <= base).all()


@pytest.mark.parametrize("name", list(ROPES))
def test_apply_rotary_matches_hf(name):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rope = ROPES[name]
    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads = 37, 4, 2
    positions = torch.cat([torch.arange(20), torch.tensor([100, 511, 1000, 4095, 8191]),
                           torch.randint(0, 16384, (12,), generator=gen)])
    q = torch.randn(n, heads, HEAD_DIM, generator=gen)
    k = torch.randn(n, kv_heads, HEAD_DIM, generator=gen)

    cos, sin = rope_cos_sin(rope_inv_freq(rope, HEAD_DIM), positions)
    q_ours, k_ours = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    rotary = _hf_rotary(rope)
    hf_cos, hf_sin = rotary(q[None], positions[None])  # (1, n, head_dim)
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(q_ours, q_hf[0].transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(k_ours, k_hf[0].transpose(0, 1), rtol=0, atol=1e-5)


def _max_rel_err(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest per-vector error relative to the vector's norm."""
    return ((a - b).norm(dim=-1) / ref.norm(dim=-1)).max().item()


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("max_pos,tol", [(256, 1e-5), (4096, 2e-4)])
def test_shift_property(name, max_pos, tol):
    """rotate(rotate(k, p), d) == rotate(k, p + d): cached keys can be moved by a delta.
    fp32 angles carry a rounding error that grows with the position (ulp(4096) ~ 5e-4 rad),
    so the tolerance is 1e-5 of |k| within the first 256 positions and looser beyond."""
    inv_freq = rope_inv_freq(ROPES[name], HEAD_DIM)
    gen = torch.Generator().manual_seed(1)
    n = 500
    k = torch.randn(n, 3, HEAD_DIM, generator=gen)
    p = torch.randint(0, max_pos, (n,), generator=gen)
    d = torch.randint(-max_pos, max_pos, (n,), generator=gen)
    d = torch.maximum(d, -p)  # keep p + d >= 0
    at_p = apply_rotary(k, *rope_cos_sin(inv_freq, p))
    shifted = apply_rotary(at_p, *rope_cos_sin(inv_freq, d))
    direct = apply_rotary(k, *rope_cos_sin(inv_freq, p + d))
    assert _max_rel_err(shifted, direct, k) < tol
    # and both agree with an exact float64 rotation
    angles = (p + d).double()[:, None] * inv_freq.double()[None, :]
    cos64, sin64 = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    k64 = k.double()
    half = HEAD_DIM // 2
    rot_half = torch.cat((-k64[..., half:], k64[..., :half]), -1)
    exact = k64 * cos64[:, None, :] + rot_half * sin64[:, None, :]
    assert _max_rel_err(shifted.double(), exact, k64) < tol
    assert _max_rel_err(direct.double(), exact, k64) < tol


def test_shift_property_small_positions_exact():
    inv_freq = rope_inv_freq(ROPES["default"], HEAD_DIM)
    k = torch.randn(10, 2, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    for p, d in [(0, 5), (3, 17), (40, -40), (100, 27), (250, -3)]:
        pos = torch.full((10,), p)
        delta = torch.full((10,), d)
        shifted = apply_rotary(apply_rotary(k, *rope_cos_sin(inv_freq, pos)), *rope_cos_sin(inv_freq, delta))
        direct = apply_rotary(k, *rope_cos_sin(inv_freq, pos + delta))
        assert _max_rel_err(shifted, direct, k) < 1e-5, (p, d)
        if p + abs(d) < 64:
            assert (shifted - direct).abs().max().item() < 1e-5, (p, d)


def test_rotation_at_position_zero_is_identity_and_preserves_norm():
    inv_freq = rope_inv_freq(ROPES["default"], HEAD_DIM)
    k = torch.randn(5, 2, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    out0 = apply_rotary(k, *rope_cos_sin(inv_freq, torch.zeros(5, dtype=torch.long)))
    torch.testing.assert_close(out0, k)
    out = apply_rotary(k, *rope_cos_sin(inv_freq, torch.arange(5) * 97))
    torch.testing.assert_close(out.norm(dim=-1), k.norm(dim=-1))
    assert not torch.allclose(out[1:], k[1:])


def test_partial_rotary_leaves_the_tail_untouched():
    rope = RopeConfig(theta=10000.0, partial_rotary_factor=0.5)
    rotary_dim = HEAD_DIM // 2
    inv_freq = rope_inv_freq(rope, rotary_dim)
    assert inv_freq.shape == (rotary_dim // 2,)
    k = torch.randn(7, 2, HEAD_DIM, generator=torch.Generator().manual_seed(4))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(7) + 3)
    out = apply_rotary(k, cos, sin)
    assert out.shape == k.shape
    torch.testing.assert_close(out[..., rotary_dim:], k[..., rotary_dim:], rtol=0, atol=0)
    full = apply_rotary(k[..., :rotary_dim], cos, sin)
    torch.testing.assert_close(out[..., :rotary_dim], full)


def test_low_precision_input_rotates_in_fp32_and_keeps_dtype():
    inv_freq = rope_inv_freq(ROPES["default"], HEAD_DIM)
    k = torch.randn(4, 2, HEAD_DIM, generator=torch.Generator().manual_seed(5))
    cos, sin = rope_cos_sin(inv_freq, torch.tensor([1, 50, 300, 2000]))
    out = apply_rotary(k.to(torch.bfloat16), cos, sin)
    assert out.dtype == torch.bfloat16
    ref = apply_rotary(k.to(torch.bfloat16).float(), cos, sin).to(torch.bfloat16)
    assert torch.equal(out, ref)


def test_refused_rope_configs():
    from engine_ext.errors import ModelLoadError

    with pytest.raises(ModelLoadError):
        RopeConfig(rope_type="dynamic")  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError):
        RopeConfig(theta=0)
    with pytest.raises(ModelLoadError):
        RopeConfig(partial_rotary_factor=0)
    with pytest.raises(ModelLoadError):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
