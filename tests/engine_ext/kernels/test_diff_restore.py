"""engine_ext.kernels.diff_restore: a mirror restored from its block-sparse diff has its touched blocks
copied bit for bit from the diff and its untouched blocks equal to the master's aligned
rows shifted to the mirror's positions (checked against a per-token loop), and its padding
(dst -1, at block ends, as the DiffStore lays a mirror out along the prompt's spans)
neither read nor written; the dense baseline and the fused Triton kernel (run on CPU
under TRITON_INTERPRET=1) agree with the torch reference."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from engine_ext.config import RopeConfig
from engine_ext.kernels.diff_restore import restore_mirror, restore_mirror_dense, restore_mirror_torch
from engine_ext.kernels.rope import rope_inv_freq
from engine_ext.kernels.rope_shift import shift_keys_torch

NUM_SLOTS = 400
KV_HEADS = 3
BLOCK = 32


def _span_blocks(spans: list[int], block_tokens: int) -> list[int]:
    """Real tokens per block when each span (a segment, or the text between segments)
    starts a new block, as the DiffStore lays a mirror out: a span's last block is padded."""
    return [min(block_tokens, span - lo) for span in spans for lo in range(0, span, block_tokens)]


def _mirror_and_padding(
    n: int,
    touched: set[int],
    *,
    block_tokens: int = BLOCK,
    real: list[int] | None = None,
    head_dim: int = 64,
    num_heads: int = KV_HEADS,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    touched_base: bool = False,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Caches and a mirror of n layout positions whose blocks `touched` are stored in the
    diff, in block order. real[b] is block b's number of real tokens (its first ones; the
    rest is padding: dst and base_src -1, delta 0), by default all of them (a short last
    block included). The diff holds real tokens only, so block b's offset is the real
    tokens of the touched blocks before it. base_src is -1 in touched blocks unless
    touched_base (then still the master's aligned slots, as in a dense store).
    Returns (k_cache, v_cache, dst, base_src, delta, block_diff, diff_slots) and the slots
    the padding positions would have restored into: no restore may write them."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_SLOTS, num_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_SLOTS, num_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(NUM_SLOTS, generator=gen)
    base_src, dst, diff_region = slots[:n].clone(), slots[n : 2 * n].clone(), slots[2 * n :]
    delta = torch.randint(-5000, 5000, (n,), generator=gen)
    num_blocks = -(-n // block_tokens)
    lengths = [min(block_tokens, n - b * block_tokens) for b in range(num_blocks)]
    real = lengths if real is None else real
    assert len(real) == num_blocks and all(0 <= r <= size for r, size in zip(real, lengths))
    token = torch.arange(n)
    is_real = token % block_tokens < torch.tensor(real, dtype=torch.long)[token // block_tokens]  # (n,)
    padding_targets = dst[~is_real].clone()
    dst[~is_real], base_src[~is_real], delta[~is_real] = -1, -1, 0
    block_diff = torch.full((num_blocks,), -1, dtype=torch.long)
    stored_tokens = 0
    for b in sorted(touched):
        block_diff[b] = stored_tokens
        stored_tokens += real[b]
        if not touched_base:
            base_src[b * block_tokens : (b + 1) * block_tokens] = -1
    diff_slots = diff_region[:stored_tokens]  # exactly the stored tokens: reading padding would overrun
    return (k_cache, v_cache, dst, base_src, delta, block_diff, diff_slots), padding_targets


def _mirror(n: int, touched: set[int], **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """The caches and mirror of `_mirror_and_padding`, without the padding's targets."""
    return _mirror_and_padding(n, touched, **kwargs)[0]


def _expected(
    caches: tuple[torch.Tensor, ...], inv_freq: torch.Tensor, block_tokens: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The restore one token at a time, straight from the definition."""
    k_cache, v_cache, dst, base_src, delta, block_diff, diff_slots = caches
    k_want, v_want = k_cache.clone(), v_cache.clone()
    for i in range(dst.shape[0]):
        if dst[i] < 0:
            continue  # padding
        b = i // block_tokens
        offset = int(block_diff[b])
        if offset >= 0:
            s = int(diff_slots[offset + i - b * block_tokens])
            k_want[dst[i]] = k_cache[s]
        else:
            s = int(base_src[i])
            k_want[dst[i]] = shift_keys_torch(k_cache[s : s + 1], delta[i : i + 1], inv_freq)[0]
        v_want[dst[i]] = v_cache[s]
    return k_want, v_want


def _restored(fn: Callable[..., None], caches: tuple[torch.Tensor, ...], inv_freq: torch.Tensor,
              block_tokens: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """fn run on copies of the caches; returns the restored (k_cache, v_cache)."""
    k_cache, v_cache, *args = caches
    k_out, v_out = k_cache.clone(), v_cache.clone()
    fn(k_out, v_out, *args, block_tokens, inv_freq)
    return k_out, v_out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaN payloads and signed zeros count."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# n, block_tokens, touched blocks, real tokens per block (None: no padding). Without
# padding: a short last block touched or not; no block touched; every block touched; one
# short block; one-token blocks.
DENSE_CASES: dict[str, tuple[int, int, set[int], list[int] | None]] = {
    "mixed_last_touched": (100, BLOCK, {1, 3}, None),
    "mixed_last_untouched": (100, BLOCK, {0, 2}, None),
    "untouched": (100, BLOCK, set(), None),
    "all_touched": (100, BLOCK, {0, 1, 2, 3}, None),
    "one_partial_block": (5, BLOCK, {0}, None),
    "single_token_blocks": (7, 1, {0, 3, 6}, None),
}
# With padding at block ends. Offsets are the comments' numbers: the touched blocks' real
# lengths differ, so most offsets are no multiples of block_tokens.
PADDED_CASES: dict[str, tuple[int, int, set[int], list[int] | None]] = {
    # Spans 20, 1, 13, 5, 11: blocks of 8 8 4 | 1 | 8 5 | 5 | 8 3 real tokens; offsets 0 4 5 10.
    "spans": (72, 8, {2, 3, 5, 8}, _span_blocks([20, 1, 13, 5, 11], 8)),
    # A whole block of padding after a 1-token stretch; offsets 0 1.
    "padding_block_after_one_token": (40, 8, {1, 4}, [8, 1, 0, 8, 6]),
    # The same with the empty block touched: it stores nothing; offsets 0 1 1.
    "touched_padding_block": (40, 8, {1, 2, 3}, [8, 1, 0, 8, 6]),
    "padded_untouched": (24, 8, set(), [5, 8, 2]),
    "padded_all_touched": (32, 8, {0, 1, 2, 3}, [3, 8, 6, 1]),  # offsets 0 3 11 17
    "padded_short_last_block": (21, 8, {1, 2}, [8, 2, 3]),  # the last block 5 long; offsets 0 2
    "padded_single_token_blocks": (7, 1, {0, 1, 3, 6}, [1, 0, 1, 1, 0, 1, 1]),  # offsets 0 1 1 2
    "padded_odd_block": (72, 24, {1, 2}, [24, 10, 17]),  # offsets 0 10
    "all_padding": (16, 8, {1}, [0, 0]),  # nothing to restore, an empty diff
}
CASES = {**DENSE_CASES, **PADDED_CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_reference_matches_the_definition(case):
    n, block_tokens, touched, real = CASES[case]
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    caches = _mirror(n, touched, block_tokens=block_tokens, real=real)
    k_out, v_out = _restored(restore_mirror_torch, caches, inv_freq, block_tokens)
    k_want, v_want = _expected(caches, inv_freq, block_tokens)
    assert torch.equal(k_out, k_want) and torch.equal(v_out, v_want)


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(32, 32), (64, 32)])
def test_reference_with_partial_rotary_and_bf16(head_dim, rotary_dim):
    inv_freq = rope_inv_freq(RopeConfig(), rotary_dim)
    caches = _mirror(100, {1, 3}, head_dim=head_dim, dtype=torch.bfloat16, seed=1)
    k_out, v_out = _restored(restore_mirror_torch, caches, inv_freq)
    k_want, v_want = _expected(caches, inv_freq)
    assert torch.equal(k_out, k_want) and torch.equal(v_out, v_want)
    _, _, dst, base_src, *_ = caches
    untouched = base_src >= 0
    assert torch.equal(k_out[dst[untouched], :, rotary_dim:], caches[0][base_src[untouched], :, rotary_dim:])


def _with_special_values(caches: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """NaN, infinities and -0.0 in the diff rows' first channels: a rotation, even by 0,
    would not carry them through (inf * sin 0 is NaN, -0.0 + 0.0 is +0.0)."""
    k_cache, v_cache, *rest = caches
    diff_slots = rest[-1]
    for cache in (k_cache, v_cache):
        cache[diff_slots, :, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0], dtype=cache.dtype)
    return (k_cache, v_cache, *rest)


@pytest.mark.parametrize(("n", "block_tokens", "touched", "real"), [
    (100, BLOCK, {0, 3}, None),
    PADDED_CASES["spans"],
])
def test_touched_blocks_are_copied_bit_for_bit(n, block_tokens, touched, real):
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    caches = _with_special_values(
        _mirror(n, touched, block_tokens=block_tokens, real=real, dtype=torch.bfloat16, seed=2)
    )
    k_cache, v_cache, dst, base_src, _, _, diff_slots = caches
    k_out, v_out = _restored(restore_mirror_torch, caches, inv_freq, block_tokens)
    # diff_slots lists the touched real tokens' rows in token order; padding has dst -1.
    touched = (base_src < 0) & (dst >= 0)
    untouched = base_src >= 0
    assert torch.equal(_bits(k_out[dst[touched]]), _bits(k_cache[diff_slots]))
    assert torch.equal(_bits(v_out[dst[touched]]), _bits(v_cache[diff_slots]))
    assert torch.equal(_bits(v_out[dst[untouched]]), _bits(v_cache[base_src[untouched]]))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("touched_base", [False, True])
def test_dense_restore_gives_identical_caches(case, touched_base):
    n, block_tokens, touched, real = CASES[case]
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    caches = _mirror(n, touched, block_tokens=block_tokens, real=real, seed=3, touched_base=touched_base)
    k_fused, v_fused = _restored(restore_mirror_torch, caches, inv_freq, block_tokens)
    k_dense, v_dense = _restored(restore_mirror_dense, caches, inv_freq, block_tokens)
    assert torch.equal(k_fused, k_dense) and torch.equal(v_fused, v_dense)


def _assert_only_real_targets_written(out: tuple[torch.Tensor, torch.Tensor], caches: tuple[torch.Tensor, ...],
                                      padding_targets: torch.Tensor) -> None:
    """Every row outside the real tokens' dst, the padding's would-be targets among them,
    is bit for bit what it was."""
    k_cache, v_cache, dst, *_ = caches
    kept = torch.ones(k_cache.shape[0], dtype=torch.bool)
    kept[dst[dst >= 0]] = False
    assert bool(kept[padding_targets].all())
    for restored, cache in zip(out, (k_cache, v_cache)):
        assert torch.equal(_bits(restored[padding_targets]), _bits(cache[padding_targets]))
        assert torch.equal(_bits(restored[kept]), _bits(cache[kept]))


@pytest.mark.parametrize("case", list(PADDED_CASES))
@pytest.mark.parametrize("fn", [restore_mirror_torch, restore_mirror_dense, restore_mirror],
                         ids=["torch", "dense", "dispatch"])
def test_padding_is_neither_read_nor_written(case, fn):
    """Padding's would-be targets keep their rows; its base_src (-1) and its offsets past
    the stored tokens (diff_slots holds exactly those) would fail the gathers if read."""
    n, block_tokens, touched, real = PADDED_CASES[case]
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    caches, padding_targets = _mirror_and_padding(n, touched, block_tokens=block_tokens, real=real, seed=9)
    assert padding_targets.numel() > 0
    out = _restored(fn, caches, inv_freq, block_tokens)
    _assert_only_real_targets_written(out, caches, padding_targets)
    k_want, v_want = _expected(caches, inv_freq, block_tokens)
    assert torch.equal(out[0], k_want) and torch.equal(out[1], v_want)


def test_dispatcher_uses_the_torch_reference_on_cpu():
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    caches = _mirror(100, {2}, seed=4)
    k_ref, v_ref = _restored(restore_mirror_torch, caches, inv_freq)
    k_out, v_out = _restored(restore_mirror, caches, inv_freq)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)


def test_bad_arguments_are_named():
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    k_cache, v_cache, dst, base_src, delta, block_diff, diff_slots = _mirror(100, {1}, seed=5)
    with pytest.raises(ValueError, match=r"block_diff must have shape \(4,\)"):
        restore_mirror_torch(k_cache, v_cache, dst, base_src, delta, block_diff[:3], diff_slots, BLOCK, inv_freq)
    with pytest.raises(ValueError, match="base_src"):
        restore_mirror_torch(k_cache, v_cache, dst, base_src[1:], delta, block_diff, diff_slots, BLOCK, inv_freq)
    with pytest.raises(ValueError, match="block_tokens"):
        restore_mirror_dense(k_cache, v_cache, dst, base_src, delta, block_diff, diff_slots, 0, inv_freq)


# --- the Triton kernel, interpreted on CPU ---------------------------------------------

# The kernel's module and the one it takes its row mover from: both must be imported
# under TRITON_INTERPRET=1, an interpreted kernel cannot call a compiled helper.
TRITON_MODULES = ("engine_ext.kernels.diff_restore_triton", "engine_ext.kernels.shift_copy_triton")


@pytest.fixture
def restore_mirror_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """restore_mirror_triton from a fresh import under TRITON_INTERPRET=1: triton.jit
    decides between compiling and interpreting when the kernel is defined, i.e. at import.
    The interpreted modules are dropped afterwards so no later import sees them."""
    pytest.importorskip("triton", reason="triton is not installed (optional extra: pip install kvrelay[triton])")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in TRITON_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(TRITON_MODULES[0])
    yield module.restore_mirror_triton
    for name in TRITON_MODULES:
        sys.modules.pop(name, None)  # monkeypatch then restores any earlier import


def _assert_matches_reference(out: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor],
                              caches: tuple[torch.Tensor, ...], block_tokens: int) -> None:
    """Rotated keys to the kernel's sin/cos (an fp32 ulp; one ulp of bf16 when that flips
    the rounding); verbatim keys, all values and every row outside dst bit for bit."""
    (k_out, v_out), (k_ref, v_ref) = out, ref
    dtype = k_out.dtype
    tol = {"rtol": 0.0, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2 * torch.finfo(dtype).eps, "atol": 1e-5}
    torch.testing.assert_close(k_out, k_ref, equal_nan=True, **tol)
    _, _, dst, _, _, block_diff, _ = caches
    touched = block_diff[torch.arange(dst.shape[0]) // block_tokens] >= 0
    kept = torch.ones(k_out.shape[0], dtype=torch.bool)
    kept[dst[~touched & (dst >= 0)]] = False  # rows written by a rotation (padding's dst -1 writes none)
    assert torch.equal(_bits(k_out[kept]), _bits(k_ref[kept]))
    assert torch.equal(_bits(v_out), _bits(v_ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "rotary_dim", "num_heads"), [(64, 64, 3), (64, 32, 3), (32, 32, 20)])
def test_triton_kernel_matches_the_reference(restore_mirror_triton, head_dim, rotary_dim, num_heads, dtype):
    """A partial, touched last block; 20 heads: three head blocks."""
    inv_freq = rope_inv_freq(RopeConfig(), rotary_dim)
    caches = _with_special_values(_mirror(100, {1, 3}, head_dim=head_dim, num_heads=num_heads, dtype=dtype, seed=6))
    out = _restored(restore_mirror_triton, caches, inv_freq)
    _assert_matches_reference(out, _restored(restore_mirror_torch, caches, inv_freq), caches, BLOCK)


@pytest.mark.parametrize(("n", "block_tokens", "touched"), [
    (100, BLOCK, set()),
    (100, BLOCK, {0, 1, 2, 3}),
    (7, 1, {0, 3, 6}),
    (50, 24, {1}),  # a block size that is no power of two
])
def test_triton_kernel_block_layouts(restore_mirror_triton, n, block_tokens, touched):
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    caches = _mirror(n, touched, block_tokens=block_tokens, seed=7)
    out = _restored(restore_mirror_triton, caches, inv_freq, block_tokens)
    ref = _restored(restore_mirror_torch, caches, inv_freq, block_tokens)
    _assert_matches_reference(out, ref, caches, block_tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(PADDED_CASES))
def test_triton_kernel_padded_layouts(restore_mirror_triton, case, dtype):
    """Padding rows masked off (nothing loaded, nothing stored) and touched blocks read at
    their offsets, NaN and infinities in the diff rows carried through."""
    n, block_tokens, touched, real = PADDED_CASES[case]
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    caches, padding_targets = _mirror_and_padding(n, touched, block_tokens=block_tokens, real=real, dtype=dtype,
                                                  seed=10)
    caches = _with_special_values(caches)
    out = _restored(restore_mirror_triton, caches, inv_freq, block_tokens)
    ref = _restored(restore_mirror_torch, caches, inv_freq, block_tokens)
    _assert_matches_reference(out, ref, caches, block_tokens)
    _assert_only_real_targets_written(out, caches, padding_targets)


def test_triton_kernel_edge_cases(restore_mirror_triton):
    inv_freq = rope_inv_freq(RopeConfig(), 64)
    k_cache, v_cache, dst, base_src, delta, block_diff, diff_slots = _mirror(100, {1}, seed=8)
    k_old = k_cache.clone()
    empty = torch.empty(0, dtype=torch.long)
    restore_mirror_triton(k_cache, v_cache, empty, empty, empty, empty, empty, BLOCK, inv_freq)
    assert torch.equal(k_cache, k_old)
    with pytest.raises(ValueError, match="block_diff"):
        restore_mirror_triton(k_cache, v_cache, dst, base_src, delta, block_diff[:1], diff_slots, BLOCK, inv_freq)
    with pytest.raises(ValueError, match="contiguous"):
        restore_mirror_triton(k_cache[:, :, ::2], v_cache[:, :, ::2], dst, base_src, delta, block_diff, diff_slots,
                              BLOCK, rope_inv_freq(RopeConfig(), 32))
