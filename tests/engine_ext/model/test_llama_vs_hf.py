"""Our compact Llama-family model over the paged KV cache must reproduce transformers' fp32
logits (max abs diff < 1e-4) for every way the engine runs it: full prefill, prefill after a
prefix-cache hit, token-by-token decode, batched decode of several sequences, mixed steps,
and end to end through LLMEngine."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_ext.config import EngineConfig, ModelConfig
from engine_ext.errors import ContextLengthError, ModelLoadError
from engine_ext.kv.cache import KVCache
from engine_ext.model import AttentionMetadata, load_model
from engine_ext.sampling import SamplingParams
from tests.helpers import make_engine
from engine_ext.request import EngineRequest

TOL = 1e-4

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 4.0}

VARIANTS = {
    "llama": dict(kind="llama"),
    "llama_tied": dict(kind="llama", tie=True),
    "qwen2": dict(kind="qwen2", tie=True),
    "qwen2_untied": dict(kind="qwen2", tie=False),
    "qwen3": dict(kind="qwen3"),
    "llama3_rope": dict(kind="llama", rope_scaling=LLAMA3),
    "linear_rope": dict(kind="llama", rope_scaling=LINEAR),
    "mistral": dict(kind="mistral", sliding_window=None),
}


class Ours:
    """Our model plus a KV cache whose slots are handed out in a scrambled order, so every
    gather really goes through the paging indirection."""

    def __init__(self, model_dir, num_blocks: int = 32, block_size: int = 16) -> None:
        self.cfg = ModelConfig.from_dir(model_dir)
        self.model = load_model(model_dir, self.cfg)
        per_block = 2 * self.cfg.num_layers * block_size * self.cfg.num_kv_heads * self.cfg.head_dim * 4
        self.cache = KVCache(self.cfg, EngineConfig(kv_cache_bytes=num_blocks * per_block, block_size=block_size))
        gen = torch.Generator().manual_seed(1234)
        self._free = torch.randperm(self.cache.num_tokens, generator=gen).tolist()

    def slots(self, n: int) -> torch.Tensor:
        out, self._free = self._free[:n], self._free[n:]
        return torch.tensor(out, dtype=torch.long)

    def forward(self, input_ids, positions, slot_mapping, prefill_chunks, decode_contexts) -> torch.Tensor:
        meta = AttentionMetadata.build(slot_mapping, prefill_chunks, decode_contexts)
        hidden = self.model(torch.tensor(input_ids, dtype=torch.long), positions, self.cache.layers, meta)
        return self.model.compute_logits(hidden)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tiny_model_dir):
    import transformers

    model_dir = tiny_model_dir(**VARIANTS[request.param])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return request.param, model_dir, hf


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # (T, vocab)


def token_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    # The oracle must be informative: logits of magnitude well above the tolerance.
    assert ref.abs().max().item() > 1.0
    assert diff < TOL, f"max abs diff {diff}"


def test_fixture_logits_are_not_degenerate(variant):
    _, model_dir, hf = variant
    cfg = ModelConfig.from_dir(model_dir)
    ref = hf_logits(hf, token_ids(20, cfg.vocab_size, 0))
    assert ref.std().item() > 0.5  # a 1e-4 tolerance means something only for O(1) logits


def test_config_read_from_checkpoint(variant):
    name, model_dir, hf = variant
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.tie_word_embeddings == VARIANTS[name].get("tie", False)
    assert cfg.qkv_bias == (VARIANTS[name]["kind"] == "qwen2")
    assert cfg.qk_norm == (VARIANTS[name]["kind"] == "qwen3")
    expected_rope = (VARIANTS[name].get("rope_scaling") or {}).get("rope_type", "default")
    assert cfg.rope.rope_type == expected_rope
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    assert cfg.eos_token_ids == (eos,)


def test_full_prefill(variant):
    _, model_dir, hf = variant
    ours = Ours(model_dir)
    ids = token_ids(45, ours.cfg.vocab_size, 1)
    slots = ours.slots(len(ids))
    logits = ours.forward(ids, torch.arange(len(ids)), slots, [(len(ids), slots)], [])
    assert_close(logits, hf_logits(hf, ids))


@pytest.mark.parametrize("num_cached", [16, 32, 7])
def test_prefill_after_prefix_hit(variant, num_cached):
    """First num_cached tokens already in the cache; the rest computed with a mask."""
    _, model_dir, hf = variant
    ours = Ours(model_dir)
    ids = token_ids(50, ours.cfg.vocab_size, 2)
    slots = ours.slots(len(ids))
    ours.forward(ids[:num_cached], torch.arange(num_cached), slots[:num_cached],
                 [(num_cached, slots[:num_cached])], [])
    rest = len(ids) - num_cached
    logits = ours.forward(ids[num_cached:], torch.arange(num_cached, len(ids)), slots[num_cached:],
                          [(rest, slots)], [])
    assert_close(logits, hf_logits(hf, ids)[num_cached:])


def test_chunked_prefill_three_chunks(variant):
    _, model_dir, hf = variant
    ours = Ours(model_dir)
    ids = token_ids(40, ours.cfg.vocab_size, 3)
    slots = ours.slots(len(ids))
    ref = hf_logits(hf, ids)
    for start, end in [(0, 13), (13, 29), (29, 40)]:
        logits = ours.forward(ids[start:end], torch.arange(start, end), slots[start:end],
                              [(end - start, slots[:end])], [])
        assert_close(logits, ref[start:end])


def test_decode_token_by_token(variant):
    _, model_dir, hf = variant
    ours = Ours(model_dir)
    ids = token_ids(30, ours.cfg.vocab_size, 4)
    slots = ours.slots(len(ids))
    ref = hf_logits(hf, ids)
    prompt = 6
    ours.forward(ids[:prompt], torch.arange(prompt), slots[:prompt], [(prompt, slots[:prompt])], [])
    for p in range(prompt, len(ids)):
        logits = ours.forward([ids[p]], torch.tensor([p]), slots[p : p + 1], [], [slots[: p + 1]])
        assert_close(logits, ref[p : p + 1])


def test_batched_decode_of_sequences_with_different_lengths(variant):
    _, model_dir, hf = variant
    ours = Ours(model_dir)
    lengths = [5, 17, 33, 2]
    seqs = [token_ids(n, ours.cfg.vocab_size, 10 + i) for i, n in enumerate(lengths)]
    seq_slots = [ours.slots(n) for n in lengths]
    for ids, slots in zip(seqs, seq_slots):  # prefill all but the last token of each
        n = len(ids) - 1
        ours.forward(ids[:n], torch.arange(n), slots[:n], [(n, slots[:n])], [])
    logits = ours.forward(
        [ids[-1] for ids in seqs],
        torch.tensor([len(ids) - 1 for ids in seqs]),
        torch.stack([slots[-1] for slots in seq_slots]),
        [],
        seq_slots,
    )
    assert logits.shape[0] == len(seqs)
    for row, ids in zip(logits, seqs):
        assert_close(row[None], hf_logits(hf, ids)[-1:])


def test_mixed_step_prefills_and_decodes(variant):
    """One forward with two prefill chunks (one after a prefix hit) and two decodes, as the
    model runner lays them out: prefill tokens first, then decode tokens."""
    _, model_dir, hf = variant
    ours = Ours(model_dir)
    vocab = ours.cfg.vocab_size
    a, b, c, d = (token_ids(n, vocab, 20 + i) for i, n in enumerate([12, 40, 9, 21]))
    sa, sb, sc, sd = (ours.slots(len(x)) for x in (a, b, c, d))
    # b has 16 tokens cached; c and d are decoding.
    ours.forward(b[:16], torch.arange(16), sb[:16], [(16, sb[:16])], [])
    ours.forward(c[:-1], torch.arange(len(c) - 1), sc[:-1], [(len(c) - 1, sc[:-1])], [])
    ours.forward(d[:-1], torch.arange(len(d) - 1), sd[:-1], [(len(d) - 1, sd[:-1])], [])
    ids = a + b[16:] + [c[-1], d[-1]]
    positions = torch.cat([torch.arange(len(a)), torch.arange(16, len(b)),
                           torch.tensor([len(c) - 1, len(d) - 1])])
    slot_mapping = torch.cat([sa, sb[16:], sc[-1:], sd[-1:]])
    logits = ours.forward(ids, positions, slot_mapping, [(len(a), sa), (len(b) - 16, sb)], [sc, sd])
    n_a, n_b = len(a), len(b) - 16
    assert_close(logits[:n_a], hf_logits(hf, a))
    assert_close(logits[n_a : n_a + n_b], hf_logits(hf, b)[16:])
    assert_close(logits[n_a + n_b][None], hf_logits(hf, c)[-1:])
    assert_close(logits[n_a + n_b + 1][None], hf_logits(hf, d)[-1:])


# -- end to end through LLMEngine ---------------------------------------------------------


def _capture_logits(engine) -> list[torch.Tensor]:
    captured: list[torch.Tensor] = []
    original = engine.model.compute_logits

    def spy(hidden):
        out = original(hidden)
        captured.append(out.clone())
        return out

    engine.model.compute_logits = spy
    return captured


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama3_rope"])
def test_engine_logits_match_hf_with_prefix_cache_hit(tiny_model_dir, name):
    import transformers

    model_dir = tiny_model_dir(**VARIANTS[name])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = make_engine(model_dir, num_blocks=32)
    captured = _capture_logits(engine)
    prompt = token_ids(40, engine.model_config.vocab_size, 5)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    first = engine.generate(prompt, params)
    assert first.num_cached_tokens == 0
    assert len(captured) == 6
    ref = hf_logits(hf, first.token_ids)
    for i, logits in enumerate(captured):
        assert_close(logits, ref[len(prompt) - 1 + i][None])
        assert int(logits.argmax()) == first.output_token_ids[i]

    captured.clear()
    second = engine.generate(prompt, params)
    assert second.num_cached_tokens == 32  # two full 16-token blocks; the last token recomputed
    assert second.output_token_ids == first.output_token_ids
    for i, logits in enumerate(captured):
        assert_close(logits, ref[len(prompt) - 1 + i][None])


def test_engine_batched_requests_match_hf(tiny_model_dir):
    import transformers

    model_dir = tiny_model_dir("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = make_engine(model_dir, num_blocks=32)
    prompts = [token_ids(n, engine.model_config.vocab_size, 30 + n) for n in (3, 19, 34)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request(EngineRequest(f"r{i}", p, params)) for i, p in enumerate(prompts)]
    while engine.has_work:
        engine.step()
    for seq in seqs:
        ref = hf_logits(hf, seq.token_ids)[len(seq.prompt_token_ids) - 1 : -1]
        assert seq.output_token_ids == ref.argmax(-1).tolist()


# -- config features the model must honour or refuse, never silently ignore -------------------

FEATURES = {
    # attention limited to the last 16 keys (Mistral v0.1 ships sliding_window=4096)
    "mistral_sliding_window": dict(kind="mistral", sliding_window=16),
    "qwen2_sliding_window": dict(kind="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0),
    "llama_gelu_mlp": dict(kind="llama", hidden_act="gelu"),
    "llama_attention_bias": dict(kind="llama", attention_bias=True),
    "llama_mlp_bias": dict(kind="llama", mlp_bias=True),
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_config_features_are_honoured_or_refused(tiny_model_dir, name):
    """A config the engine accepts must give transformers' logits. One it cannot run exactly
    must be refused: ModelLoadError at load, or (for a sliding window) a context limited to
    the window so that the window never matters. Silently computing something else gives
    wrong answers."""
    import transformers

    model_dir = tiny_model_dir(**FEATURES[name])
    try:
        engine = make_engine(model_dir, num_blocks=16)
    except ModelLoadError:
        return
    captured = _capture_logits(engine)
    prompt = token_ids(40, engine.model_config.vocab_size, 6)  # longer than the 16-token windows
    try:
        seq = engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    except ContextLengthError:
        window = FEATURES[name].get("sliding_window")
        assert window is not None and engine.max_model_len <= window
        return
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref = hf_logits(hf, seq.token_ids)[len(prompt) - 1 : -1]
    assert_close(torch.cat(captured), ref)


# -- low precision ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_engine_tracks_fp32(tiny_model_dir, dtype):
    model_dir = tiny_model_dir("llama")
    fp32 = make_engine(model_dir, num_blocks=16)
    low = make_engine(model_dir, num_blocks=16, dtype=dtype)
    assert low.kv_cache.layers[0][0].dtype == getattr(torch, dtype)
    assert next(low.model.parameters()).dtype == getattr(torch, dtype)
    assert low.model.inv_freq.dtype == torch.float32
    got_fp32, got_low = _capture_logits(fp32), _capture_logits(low)
    prompt = token_ids(30, fp32.model_config.vocab_size, 8)
    out = fp32.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)).token_ids
    got_fp32.clear()
    # teacher-forced: both engines score the same token prefixes
    for n in range(len(prompt), len(out)):
        fp32.generate(out[:n], SamplingParams(max_tokens=1, temperature=0.0))
        low.generate(out[:n], SamplingParams(max_tokens=1, temperature=0.0))
    assert len(got_fp32) == len(got_low) == 4
    for a, b in zip(got_fp32, got_low):
        assert b.dtype == torch.float32
        assert torch.isfinite(b).all()
        rel = ((a - b).abs().max() / a.abs().max()).item()
        assert rel < 0.05, rel


# -- loading errors -------------------------------------------------------------------------


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    if "rope_scaling" in changes:  # a transformers 4.x style config: rope_theta + rope_scaling
        raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                             "original_max_position_embeddings": 64}},
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}},
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
    ],
)
def test_length_dependent_rope_is_refused(tiny_model_dir, tmp_path, changes):
    model_dir = _copy_with_config(tiny_model_dir("llama"), tmp_path / "m", **changes)
    with pytest.raises(ModelLoadError):
        ModelConfig.from_dir(model_dir)
    with pytest.raises(ModelLoadError):
        make_engine(model_dir)


def test_transformers4_style_rope_scaling_is_read(tiny_model_dir, tmp_path):
    model_dir = _copy_with_config(tiny_model_dir("llama"), tmp_path / "m", rope_scaling=LLAMA3)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.rope.rope_type == "llama3"
    assert cfg.rope.factor == 8.0
    assert cfg.rope.original_max_position_embeddings == 64
    assert cfg.rope.theta == 10000.0


def test_unsupported_model_type_is_refused(tiny_model_dir, tmp_path):
    model_dir = _copy_with_config(tiny_model_dir("llama"), tmp_path / "m", model_type="gpt2")
    with pytest.raises(ModelLoadError, match="gpt2"):
        ModelConfig.from_dir(model_dir)


def test_checkpoint_missing_a_tensor(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    model_dir = tmp_path / "m"
    shutil.copytree(src, model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="down_proj"):
        load_model(model_dir, ModelConfig.from_dir(model_dir))


def test_untied_checkpoint_missing_lm_head(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lm_head"):
        load_model(model_dir, ModelConfig.from_dir(model_dir))


def test_checkpoint_shape_mismatch(tiny_model_dir, tmp_path):
    model_dir = _copy_with_config(tiny_model_dir("llama"), tmp_path / "m", intermediate_size=96)
    with pytest.raises(ModelLoadError):
        load_model(model_dir, ModelConfig.from_dir(model_dir))


def test_checkpoint_with_unused_tensor(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="o_proj.bias"):
        load_model(model_dir, ModelConfig.from_dir(model_dir))


def test_sharded_checkpoint_and_unprefixed_names(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    ref = Ours(src)
    ids = token_ids(20, ref.cfg.vocab_size, 9)
    slots = ref.slots(20)
    expected = ref.forward(ids, torch.arange(20), slots, [(20, slots)], [])

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(src / "config.json", sharded / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, chunk in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(sharded / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ours = Ours(sharded)
    slots = ours.slots(20)
    assert torch.equal(ours.forward(ids, torch.arange(20), slots, [(20, slots)], []), expected)

    bare = tmp_path / "bare"  # checkpoints saved from the inner model have no "model." prefix
    bare.mkdir()
    shutil.copy(src / "config.json", bare / "config.json")
    save_file({n.removeprefix("model."): t for n, t in tensors.items()}, str(bare / "model.safetensors"))
    ours = Ours(bare)
    slots = ours.slots(20)
    assert torch.equal(ours.forward(ids, torch.arange(20), slots, [(20, slots)], []), expected)


def test_no_weights_and_no_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(ModelLoadError):
        ModelConfig.from_dir(tmp_path / "absent")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path, None)  # type: ignore[arg-type]
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError):
        load_model(tmp_path, None)  # type: ignore[arg-type]
