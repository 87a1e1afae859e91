"""The engine with adapters: multi-LoRA equals the merged model, ICaRus equals separate
encoder and decoder runs, and ICaRus adapters share one cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine_ext.adapters import load_lora
from engine_ext.adapters.marks import TrainedAs, training_metadata
from engine_ext.config import AdapterSpec, EngineConfig, ModelConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.errors import InvalidRequestError
from engine_ext.kv.cache import KVCache
from engine_ext.model import AttentionMetadata, load_model
from engine_ext.sampling import SamplingParams
from tests.engine_ext.adapters.test_rows import _merged
from tests.helpers import kv_bytes
from engine_ext.request import EngineRequest

PROMPT = [5, 17, 33, 2, 90, 41, 7, 12, 64, 3, 28, 19, 77, 8, 50, 11, 23, 6, 44]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter_for(cfg: ModelConfig, path: Path, seed: int, scale: float = 0.5,
                      trained_as: TrainedAs | None = None) -> Path:
    """A random PEFT LoRA adapter on every projection. `trained_as` marks it as
    `kvrelay train` marks what it trained (training_metadata): the random factors stand
    in for trained ones, whose effect on a tiny model would be too small to see. None:
    a plain PEFT adapter, which `auto` serves as multi_lora and `icarus` refuses."""
    q, kv, hidden, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (out_f, in_f) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{PARENT[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = scale * torch.randn((4, in_f), generator=gen)
            tensors[f"{key}.lora_B.weight"] = scale * torch.randn((out_f, 4), generator=gen)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata=training_metadata(trained_as))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 4}))
    return path


@pytest.fixture
def model_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def _engine(model_dir: Path, *specs: AdapterSpec) -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=kv_bytes(64), reuse=ReuseConfig(enabled=False), adapters=specs)
    return LLMEngine(model_dir, config)


def _reference_icarus(model_dir: Path, adapter_dir: Path, first_from_base: bool = False) -> list[int]:
    """The logical encoder (base) writes every K/V; the logical decoder (base with the
    adapter merged) reads them for each prediction and writes only a scratch slot."""
    cfg = ModelConfig.from_dir(model_dir)
    encoder = load_model(model_dir, cfg)
    decoder = _merged(encoder, load_lora(adapter_dir, cfg, "ref"))
    cache = KVCache(cfg, EngineConfig(kv_cache_bytes=kv_bytes(64)))
    scratch = torch.tensor([cache.num_tokens - 1])
    context = torch.arange(len(PROMPT))
    hidden = encoder(torch.tensor(PROMPT), context, cache.layers, AttentionMetadata.build(context, [(len(PROMPT), context)], []))
    token, out = PROMPT[-1], []
    for step in range(GREEDY.max_tokens):
        if step == 0 and first_from_base:
            logits = encoder.compute_logits(hidden[-1:])
        else:
            position = torch.tensor([len(context) - 1])
            h = decoder(torch.tensor([token]), position, cache.layers, AttentionMetadata.build(scratch, [], [context]))
            logits = decoder.compute_logits(h)
        token = int(logits.argmax(-1))
        out.append(token)
        position = torch.tensor([len(context)])
        context = torch.cat([context, position])
        encoder(torch.tensor([token]), position, cache.layers, AttentionMetadata.build(position, [], [context]))
    return out


@pytest.mark.parametrize("first_token", ["adapter", "base"])
def test_icarus_generation_equals_separate_encoder_and_decoder(model_dir, tmp_path, first_token):
    adapter_dir = write_adapter_for(ModelConfig.from_dir(model_dir), tmp_path / "math", seed=1, trained_as="icarus")
    engine = _engine(model_dir, AdapterSpec("math", str(adapter_dir), "icarus", first_token))
    seq = engine.generate(PROMPT, GREEDY, adapter="math")
    assert seq.output_token_ids == _reference_icarus(model_dir, adapter_dir, first_from_base=first_token == "base")
    assert seq.output_token_ids != engine.generate(PROMPT, GREEDY).output_token_ids  # the adapter matters


def test_multi_lora_generation_equals_the_merged_model(model_dir, tmp_path):
    adapter_dir = write_adapter_for(ModelConfig.from_dir(model_dir), tmp_path / "code", seed=2)
    engine = _engine(model_dir, AdapterSpec("code", str(adapter_dir), "multi_lora"))
    adapted = engine.generate(PROMPT, GREEDY, adapter="code", record_logits=True)
    merged = _engine(model_dir)
    merged.model = _merged(merged.model, load_lora(adapter_dir, merged.model_config, "code"))
    merged.runner.model = merged.model
    reference = merged.generate(PROMPT, GREEDY, record_logits=True)
    assert adapted.output_token_ids == reference.output_token_ids
    torch.testing.assert_close(torch.stack(adapted.logits), torch.stack(reference.logits), rtol=1e-4, atol=1e-4)


def test_icarus_adapters_share_the_history_and_multi_lora_ones_do_not(model_dir, tmp_path):
    cfg = ModelConfig.from_dir(model_dir)
    specs = [AdapterSpec(name, str(write_adapter_for(cfg, tmp_path / name, seed=i, trained_as=trained_as)), mode)
             for i, (name, mode, trained_as) in enumerate([("plan", "icarus", "icarus"), ("act", "icarus", "icarus"),
                                                           ("l1", "multi_lora", None), ("l2", "multi_lora", "lora")])]
    engine = _engine(model_dir, *specs)
    for first, second in (("plan", "act"), ("l1", "l2")):
        turn = engine.generate(PROMPT, GREEDY, adapter=first)
        history = turn.token_ids[:-1] + [turn.token_ids[-1], 9, 9, 9]  # the answer, then the next message
        switched = engine.generate(history, GREEDY, adapter=second)
        shared = (len(turn.token_ids) - 1) // 16 * 16  # every full block the first turn computed
        assert switched.num_cached_tokens == (shared if first == "plan" else 0)


def test_an_unknown_adapter_is_refused(model_dir):
    engine = _engine(model_dir)
    with pytest.raises(InvalidRequestError, match="unknown adapter 'nope'"):
        engine.add_request(EngineRequest("r", PROMPT, GREEDY, adapter="nope"))


def test_the_server_selects_an_adapter_by_model_name(model_dir, tmp_path, run_server):
    import httpx

    adapter_dir = write_adapter_for(ModelConfig.from_dir(model_dir), tmp_path / "math", seed=1, trained_as="icarus")
    engine = _engine(model_dir, AdapterSpec("math", str(adapter_dir), "icarus"))
    expected = engine.generate(PROMPT, GREEDY, adapter="math").output_token_ids
    body = {"prompt": PROMPT, "max_tokens": GREEDY.max_tokens, "temperature": 0.0, "ignore_eos": True}
    with run_server(engine, "tiny") as srv:
        models = httpx.get(f"{srv.v1}/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny", "tiny:math"]
        reply = httpx.post(f"{srv.v1}/completions", json={**body, "model": "tiny:math"}, timeout=30).json()
        assert reply["choices"][0]["text"] == engine.tokenizer.decode(expected)
        assert reply["model"] == "tiny:math"
        for wrong in ("tiny:nope", "tiny:", "other:math"):
            missing = httpx.post(f"{srv.v1}/completions", json={**body, "model": wrong}, timeout=30)
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found", wrong
    assert reply["usage"]["completion_tokens"] == GREEDY.max_tokens


def test_icarus_adapters_share_the_segment_index_and_multi_lora_ones_do_not(tiny_model_dir, tmp_path):
    """A document cached by one ICaRus adapter's request is reused by another adapter's,
    and the answer equals a dense run (the first token comes from the decoder after the
    reused prefill); a multi-LoRA request neither stores nor reads segments."""
    from engine_ext.reuse.segments import TokenSegment

    model_dir = tiny_model_dir("llama", num_hidden_layers=4)
    cfg = ModelConfig.from_dir(model_dir)
    specs = [AdapterSpec(name, str(write_adapter_for(cfg, tmp_path / name, seed=i, trained_as=trained_as)), mode)
             for i, (name, mode, trained_as) in enumerate([("plan", "icarus", "icarus"), ("act", "icarus", "icarus"),
                                                           ("l1", "multi_lora", None)])]
    reuse = ReuseConfig(check_layers=(0,), min_segment_tokens=4)
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=2 * kv_bytes(96), reuse=reuse, adapters=tuple(specs)))
    prefix, doc = PROMPT[:11], [(7 * i + 3) % 190 + 5 for i in range(37)]
    segment = TokenSegment(len(prefix), len(prefix) + len(doc), "shared_block", None, "shift", 0)
    engine.generate(prefix + doc + [9, 9, 9], GREEDY, segments=[segment], publish=False, adapter="plan")
    prompt = prefix + doc + [4, 8, 15, 16, 23]
    reused = engine.generate(prompt, GREEDY, segments=[segment], publish=False, adapter="act")
    (outcome,) = reused.reuse_outcomes
    assert outcome.method == "shift" and outcome.num_reused == len(doc)
    assert reused.output_token_ids == engine.generate(prompt, GREEDY, publish=False, adapter="act").output_token_ids
    lora = engine.generate(prompt, GREEDY, segments=[segment], publish=False, adapter="l1")
    assert not lora.reuse_outcomes and lora.num_cached_tokens == 0


def test_a_base_name_with_a_colon_still_serves_itself_and_its_adapters(model_dir, tmp_path, run_server):
    import httpx

    adapter_dir = write_adapter_for(ModelConfig.from_dir(model_dir), tmp_path / "math", seed=1, trained_as="icarus")
    engine = _engine(model_dir, AdapterSpec("math", str(adapter_dir), "icarus"))
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    with run_server(engine, "llama3:8b") as srv:
        for model in ("llama3:8b", "llama3:8b:math"):
            reply = httpx.post(f"{srv.v1}/completions", json={**body, "model": model}, timeout=30)
            assert reply.status_code == 200 and reply.json()["model"] == model


def test_mixed_batches_chunked_prefills_and_preemption_change_no_answer(model_dir, tmp_path):
    """Base, ICaRus (both first-token variants) and multi-LoRA requests run together on
    an engine whose prefills are chunked and whose KV pool is too small for all of them
    (so some are preempted and recomputed): each answer equals that request run alone."""
    cfg = ModelConfig.from_dir(model_dir)
    specs = (AdapterSpec("plan", str(write_adapter_for(cfg, tmp_path / "plan", seed=1, trained_as="icarus")), "icarus"),
             AdapterSpec("act", str(write_adapter_for(cfg, tmp_path / "act", seed=2, trained_as="icarus")), "icarus",
                         "base"),
             AdapterSpec("code", str(write_adapter_for(cfg, tmp_path / "code", seed=3)), "multi_lora"))
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + k) % 300 + 5 for k in range(40 + 9 * i)] for i in range(6)]
    adapters = ["plan", "act", None, "code", "plan", "act"]
    alone = _engine(model_dir, *specs)
    expected = [alone.generate(p, sampling, adapter=a).output_token_ids for p, a in zip(prompts, adapters)]
    tight = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=kv_bytes(16), max_num_batched_tokens=32,
                                              reuse=ReuseConfig(enabled=False), adapters=specs))
    seqs = [tight.add_request(EngineRequest(f"r{i}", p, sampling, adapter=a)) for i, (p, a) in enumerate(zip(prompts, adapters))]
    while tight.has_work:
        tight.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    assert [s.output_token_ids for s in seqs] == expected
