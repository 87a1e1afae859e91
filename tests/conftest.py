"""Session fixtures: seeded random tiny HF models (+ a trained byte-level BPE tokenizer),
the real SmolLM2 directory, and a loopback server runner."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import CORPUS, serve

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _train_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "model_max_length": 512,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tok.get_vocab_size(with_added_tokens=True)


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """HF's std-0.02 init gives near-zero logits; use a larger scale so logits are O(1-10)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def build_tiny_model(out: Path, kind: str, tok_dir: Path, vocab: int, tie: bool = False,
                     rope_scaling: dict[str, Any] | None = None, seed: int = 0,
                     extra: dict[str, Any] | None = None) -> Path:
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, out / name)
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=None,
    )
    if rope_scaling is not None:
        common["rope_scaling"] = rope_scaling
    common.update(extra or {})
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg, cls = transformers.MistralConfig(head_dim=16, **common), transformers.MistralForCausalLM
    elif kind == "qwen3":
        cfg, cls = transformers.Qwen3Config(head_dim=16, **common), transformers.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    _reinit(model, seed)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    vocab = _train_tokenizer(out)
    return out, vocab


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer_dir) -> Callable[..., Path]:
    """Factory: tiny_model_dir(kind="llama", tie=False, rope_scaling=None, seed=0, **config_overrides)
    -> model dir. kind is llama | qwen2 | qwen3 | mistral. Built once per distinct argument set."""
    tok_dir, vocab = tiny_tokenizer_dir
    built: dict[str, Path] = {}

    def make(kind: str = "llama", tie: bool = False, rope_scaling: dict[str, Any] | None = None,
             seed: int = 0, **extra: Any) -> Path:
        key = json.dumps([kind, tie, rope_scaling, seed, extra], sort_keys=True)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny_{kind}")
            built[key] = build_tiny_model(out, kind, tok_dir, vocab, tie, rope_scaling, seed, extra)
        return built[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from engine_ext.model_store import prepare_default_model

    return prepare_default_model(progress=False)


@pytest.fixture(scope="session")
def run_server():
    """`with run_server(llm, name) as srv:` runs the OpenAI server on a loopback port."""
    return serve
