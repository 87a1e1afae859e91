"""ICaRus only for adapters trained for it: `kvrelay train` marks what it trained, `auto`
serves a marked ICaRus adapter in icarus mode and anything else as multi-LoRA, and an
explicit `icarus` on an adapter not marked as ICaRus-trained is refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_ext.adapters.marks import MARK_KEY, read_trained_as, training_metadata
from engine_ext.adapters.registry import AdapterRegistry
from engine_ext.adapters.training import LoraFactors, TrainMode, train
from engine_ext.config import AdapterSpec, EngineConfig, ModelConfig, ReuseConfig
from engine_ext.engine import LLMEngine
from engine_ext.errors import ModelLoadError
from tests.engine_ext.adapters.test_engine_adapters import GREEDY, PROMPT, _reference_icarus, write_adapter_for
from tests.engine_ext.adapters.test_lora import CFG, write_adapter
from tests.engine_ext.adapters.test_rows import _model
from tests.helpers import kv_bytes

EXAMPLES = [([3, 9, 4, 1], [22, 7, 5]), ([8, 8, 2], [30, 1, 6, 11])]


def _trained(path: Path, mode: TrainMode) -> LoraFactors:
    """An adapter as `kvrelay train MODE` writes it (the same train() and save())."""
    factors, _ = train(_model(), EXAMPLES, mode, rank=4, steps=1)
    factors.save(path)
    return factors


def _registry(*specs: AdapterSpec) -> AdapterRegistry:
    return AdapterRegistry(specs, CFG, "tiny", torch.float32)


@pytest.mark.parametrize(("mode", "served"), [("icarus", "icarus"), ("lora", "multi_lora")])
def test_the_mark_survives_a_save_load_round_trip(tmp_path, mode, served):
    factors = _trained(tmp_path / "a", mode)
    assert read_trained_as(tmp_path / "a", "a") == mode
    adapter = _registry(AdapterSpec("a", str(tmp_path / "a"))).get("a")  # auto, the default
    assert (adapter.trained_as, adapter.mode, adapter.spec.mode) == (mode, served, served)
    assert (adapter.hash_root is None) == (served == "icarus")  # icarus K/V are the base model's
    (q_part, *_) = adapter.lora.parts[(0, "self_attn.qkv_proj")]
    torch.testing.assert_close(q_part.a, factors.a["0_q_proj"].detach())  # the weights came back too
    weights = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert not any(MARK_KEY in key for key in weights)  # the mark is header metadata, never a tensor


def test_auto_serves_a_marked_icarus_adapter_in_icarus_mode(tiny_model_dir, tmp_path):
    """Under `auto` an adapter marked as ICaRus-trained generates what the separate
    encoder (base writes the cache) and decoder (base + adapter reads it) generate."""
    model_dir = tiny_model_dir("llama")
    adapter_dir = write_adapter_for(ModelConfig.from_dir(model_dir), tmp_path / "math", seed=1, trained_as="icarus")
    engine = LLMEngine(model_dir, EngineConfig(kv_cache_bytes=kv_bytes(64), reuse=ReuseConfig(enabled=False),
                                               adapters=(AdapterSpec("math", str(adapter_dir)),)))
    assert engine.adapters.modes() == {"math": "icarus"}
    assert engine.generate(PROMPT, GREEDY, adapter="math").output_token_ids == _reference_icarus(model_dir, adapter_dir)


def test_auto_serves_an_unmarked_adapter_as_multi_lora(tmp_path):
    """A plain PEFT adapter (no mark) is served exactly as an explicit multi_lora one: its
    own K/V under its own prefix namespace (test_peft_parity checks its logits against peft)."""
    write_adapter(tmp_path / "plain")
    registry = _registry(AdapterSpec("p", str(tmp_path / "plain")))
    explicit = _registry(AdapterSpec("p", str(tmp_path / "plain"), "multi_lora")).get("p")
    adapter = registry.get("p")
    assert (adapter.mode, adapter.trained_as, adapter.hash_root) == ("multi_lora", None, explicit.hash_root)
    assert registry.modes() == {"p": "multi_lora"}


@pytest.mark.parametrize("trained_as", [None, "lora"])
def test_explicit_icarus_refuses_an_adapter_not_trained_for_it(tmp_path, trained_as):
    if trained_as is None:
        write_adapter(tmp_path / "a")
    else:
        _trained(tmp_path / "a", trained_as)
    with pytest.raises(ModelLoadError) as refused:
        _registry(AdapterSpec("critic", str(tmp_path / "a"), "icarus"))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"adapter 'critic' ({tmp_path / 'a'})")
    assert "kvrelay train icarus" in message and "--adapter-mode multi_lora" in message
    assert ("conventional LoRA" if trained_as else "no ICaRus training mark") in message


def test_explicit_modes_on_marked_adapters(tmp_path):
    """An explicit icarus serves an ICaRus-marked adapter; an explicit multi_lora serves
    any adapter (the icarus benchmark runs the same files in both modes)."""
    _trained(tmp_path / "ic", "icarus")
    registry = _registry(AdapterSpec("a", str(tmp_path / "ic"), "icarus"),
                         AdapterSpec("b", str(tmp_path / "ic"), "multi_lora"))
    assert registry.modes() == {"a": "icarus", "b": "multi_lora"}
    assert registry.get("b").trained_as == "icarus" and registry.get("b").hash_root is not None


def test_an_unknown_mark_is_refused_not_guessed(tmp_path):
    tensors = write_adapter(tmp_path / "a")
    save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"), metadata={MARK_KEY: "dpo"})
    with pytest.raises(ModelLoadError, match=f"unknown {MARK_KEY} 'dpo' \\(icarus \\| lora\\)"):
        _registry(AdapterSpec("a", str(tmp_path / "a")))
    with pytest.raises(ValueError, match="unknown training mode"):
        training_metadata("dpo")  # type: ignore[arg-type]


def test_the_default_mode_is_auto_and_a_bad_one_is_named():
    assert AdapterSpec("a", "/x").mode == "auto"
    with pytest.raises(ValueError, match=r"Input should be 'auto', 'icarus' or 'multi_lora' \[type=literal_error, input_value='dense'"):
        AdapterSpec("a", "/x", "dense")  # type: ignore[arg-type]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The real `kvrelay` command in its own process."""
    code = "import sys; from kvrelay.cli import main; sys.argv = ['kvrelay', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_cli_marks_what_it_trains_and_refuses_icarus_for_other_adapters(tiny_model_dir, tmp_path):
    """`kvrelay train lora` marks its adapter as a conventional LoRA; `kvrelay engine` and
    `kvrelay up` with --adapter-mode icarus refuse it, and a plain PEFT adapter, with one
    line and exit code 2 before serving anything."""
    model_dir = tiny_model_dir("llama")
    data = Path(__file__).resolve().parents[3] / "data" / "tiny_math.jsonl"
    trained = _cli("train", "lora", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "lora"),
                   "--steps", "1", "--max-examples", "2", "--rank", "2")
    assert trained.returncode == 0, trained.stderr
    assert "--adapter-mode auto serves it as multi_lora" in trained.stdout
    assert read_trained_as(tmp_path / "lora", "lora") == "lora"
    plain = write_adapter_for(ModelConfig.from_dir(model_dir), tmp_path / "plain", seed=1)
    for command, path, what in (("engine", plain, "no ICaRus training mark"),
                                ("up", tmp_path / "lora", "trained as a conventional LoRA")):
        ports = ("--port", "1") + (("--engine-port", "1") if command == "up" else ())  # never serve if not refused
        proc = _cli(command, "--model", str(model_dir), "--adapter", f"x={path}", "--adapter-mode", "icarus", *ports)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"kvrelay: error: adapter 'x' ({path}) ") and what in lines[0]
        assert "retrain it with `kvrelay train icarus`, or serve it with --adapter-mode multi_lora" in lines[0]
