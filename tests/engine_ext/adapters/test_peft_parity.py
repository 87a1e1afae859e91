"""multi_lora mode reproduces `peft`: an adapter written by peft's own save_pretrained,
served by the engine, gives the logits peft's LoRA model gives (fp32, max abs diff 1e-4),
also when `auto` picks the mode (a plain PEFT adapter carries no ICaRus mark); and peft
loads what `kvrelay train` writes, its mark included, without a word."""

from __future__ import annotations

import warnings

import pytest
import torch

from engine_ext.config import AdapterSpec, EngineConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.sampling import SamplingParams
from tests.helpers import kv_bytes

peft = pytest.importorskip("peft", reason="peft is a dev dependency: pip install -e '.[dev]'")
transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 33, 2, 90, 41, 7, 12, 64, 3, 28, 19, 77, 8, 50, 11, 23, 6, 44]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_adapter(model_dir, out, target_modules: list[str], rank: int, alpha: int):
    """A LoRA model from peft with every factor random (peft starts B at zero), saved in its format."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(out)
    return model.eval()


@pytest.mark.parametrize("targets, rank, alpha, mode", [(MODULES, 4, 8, "multi_lora"),
                                                       (["q_proj", "v_proj", "down_proj"], 2, 2, "multi_lora"),
                                                       (MODULES, 4, 8, "auto")])
def test_multi_lora_matches_peft(tiny_model_dir, tmp_path, targets, rank, alpha, mode):
    model_dir = tiny_model_dir("llama")
    reference = _peft_adapter(model_dir, tmp_path / "peft", targets, rank, alpha)
    spec = AdapterSpec("p", str(tmp_path / "peft"), mode)
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=kv_bytes(64), reuse=ReuseConfig(enabled=False),
                                               adapters=(spec,)))
    served = engine.adapters.get("p")
    assert (served.mode, served.trained_as, served.hash_root is not None) == ("multi_lora", None, True)
    sampling = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ours = engine.generate(PROMPT, sampling, adapter="p", record_logits=True)
    ids = list(PROMPT)
    with torch.no_grad():
        for logits in ours.logits:
            expected = reference(torch.tensor([ids])).logits[0, -1]  # (vocab,)
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
            ids.append(int(expected.argmax()))
    assert ours.output_token_ids == ids[len(PROMPT):]
    base = engine.generate(PROMPT, sampling, record_logits=True)
    assert not torch.allclose(base.logits[0], ours.logits[0], atol=1e-3)  # the adapter matters


@pytest.mark.parametrize("trained_as", ["icarus", "lora"])
def test_peft_loads_what_kvrelay_train_writes(tiny_model_dir, tmp_path, trained_as):
    """An adapter saved by the trainer, its mark included, is a PEFT adapter: peft loads it
    without a warning (an extra adapter_config.json key would make it say the adapter
    needs a newer peft) and computes the logits of the trainer's own conventional-LoRA
    forward, which is what the weights compute on their own K/V whatever the training."""
    from engine_ext.adapters.marks import read_trained_as
    from engine_ext.adapters.training import LoraFactors, forward_logits
    from engine_ext.config import ModelConfig
    from engine_ext.model import load_model

    model_dir = tiny_model_dir("llama")
    model = load_model(model_dir, ModelConfig.from_dir(model_dir))
    factors = LoraFactors(model, rank=4, alpha=8.0, modules=tuple(MODULES), seed=5, trained_as=trained_as)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for b in factors.b.values():
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    factors.save(tmp_path / "ours")
    assert read_trained_as(tmp_path / "ours", "ours") == trained_as
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = peft.PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    assert not [w for w in caught if "nexpected" in str(w.message)], [str(w.message) for w in caught]
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]  # (T, vocab)
        ours = forward_logits(model, factors, torch.tensor(PROMPT), "lora")
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    # Weights peft writes again (as after further training with it) no longer carry the
    # mark: the claim about how they were trained does not outlive them.
    reference.save_pretrained(tmp_path / "resaved")
    assert read_trained_as(tmp_path / "resaved", "resaved") is None
