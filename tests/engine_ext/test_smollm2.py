"""The real default model (SmolLM2-135M-Instruct, fp32): it must answer, and match transformers."""

from __future__ import annotations

import openai
import pytest
import torch

from engine_ext.config import EngineConfig
from engine_ext.engine import LLMEngine
from engine_ext.model_store import DEFAULT_MODEL_NAME
from engine_ext.sampling import SamplingParams


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return LLMEngine(smollm2_dir, EngineConfig(kv_cache_bytes=64 * 2**20), DEFAULT_MODEL_NAME)


def test_greedy_answer_mentions_paris(smol):
    ids = smol.tokenizer.encode(smol.tokenizer.render_chat(QUESTION))
    seq = smol.generate(ids, SamplingParams(max_tokens=32, temperature=0.0))
    assert "Paris" in seq.detokenizer.text
    assert seq.finish_reason == "stop"  # it ends its answer with <|im_end|>
    assert seq.output_token_ids[-1] in smol.eos_token_ids


def test_logits_match_transformers_with_prefix_hit(smol, smollm2_dir):
    import transformers

    captured = []
    original = smol.model.compute_logits
    smol.model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]
    try:
        ids = smol.tokenizer.encode(smol.tokenizer.render_chat(QUESTION))
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        smol.kv.pool.reset_cache()
        first = smol.generate(ids, params)
        second = smol.generate(ids, params)
    finally:
        del smol.model.compute_logits
    assert second.num_cached_tokens > 0
    assert second.output_token_ids == first.output_token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([first.token_ids])).logits[0, len(ids) - 1 : -1]
    ours = torch.cat(captured)
    assert ours.shape == (16, ref.shape[1])
    assert (ours[:8] - ref).abs().max().item() < 2e-4
    assert (ours[8:] - ref).abs().max().item() < 2e-4


def test_server_answers_with_openai_client(smol, run_server):
    with run_server(smol, DEFAULT_MODEL_NAME) as srv:
        with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60) as client:
            resp = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION,
                                                  max_tokens=32, temperature=0)
            assert "Paris" in resp.choices[0].message.content
            assert resp.choices[0].finish_reason == "stop"
            chunks = list(client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=QUESTION,
                                                         max_tokens=32, temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert streamed == resp.choices[0].message.content
            assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        assert srv.wait_idle(5)
