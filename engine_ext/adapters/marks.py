"""How an adapter was trained, recorded where it cannot drift from its weights.

ICaRus mode serves an adapter as a logical decoder over the frozen base's K/V. That is
the model the adapter is only if it was trained that way (`kvrelay train icarus`); a
conventionally trained LoRA served so silently becomes a different model. Nothing in
PEFT's format says how an adapter was trained, so `kvrelay train` writes a mark, and
the registry serves an adapter in icarus mode only when the mark says `icarus`.

The mark is one entry in the safetensors header of `adapter_model.safetensors`:
`"kvrelay.trained_as": "icarus" | "lora"` (the `kvrelay train` mode). Not in
adapter_config.json: PEFT turns every key of that file into a LoraConfig argument, so
an extra key makes PEFT >= 0.13 warn that the adapter needs a newer PEFT, and older
PEFT refuse to load it at all. The header's metadata is ignored by PEFT, vLLM and
safetensors itself, and is bound to the weights: a tool that rewrites the weights
(PEFT's save_pretrained after further training, a conversion) writes a new header
without the mark, so the adapter falls back to multi_lora instead of keeping a claim
about weights it no longer describes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, TypeGuard, get_args

from safetensors import SafetensorError, safe_open

from engine_ext.config import AdapterSpec
from engine_ext.errors import ModelLoadError

TrainedAs = Literal["icarus", "lora"]  # the modes of `kvrelay train`
ServedMode = Literal["icarus", "multi_lora"]  # what `auto` resolves to
MARK_KEY = "kvrelay.trained_as"
WEIGHTS_FILE = "adapter_model.safetensors"


def training_metadata(trained_as: TrainedAs | None) -> dict[str, str]:
    """The safetensors metadata `kvrelay train` writes: PEFT's own `format` entry, and
    the mark when the factors were trained (None: a plain, unmarked PEFT adapter)."""
    metadata = {"format": "pt"}
    if trained_as is not None:
        if trained_as not in get_args(TrainedAs):
            raise ValueError(f"unknown training mode {trained_as!r} (icarus | lora)")
        metadata[MARK_KEY] = trained_as
    return metadata


def read_trained_as(adapter_dir: Path, name: str) -> TrainedAs | None:
    """The adapter's mark, or None when it has none (any adapter not written by
    `kvrelay train`); a mark kvrelay does not know is refused rather than guessed at."""
    path = Path(adapter_dir) / WEIGHTS_FILE
    try:
        with safe_open(str(path), framework="pt") as weights:
            metadata: dict[str, str] = weights.metadata() or {}  # safetensors leaves it untyped
    except (OSError, ValueError, SafetensorError) as exc:
        raise ModelLoadError(f"adapter {name!r}: cannot read {WEIGHTS_FILE}: {exc}") from exc
    value = metadata.get(MARK_KEY)
    if value is None:
        return None
    if not _is_trained_as(value):
        raise ModelLoadError(f"adapter {name!r}: {path}: unknown {MARK_KEY} {value!r} (icarus | lora)")
    return value


def _is_trained_as(value: str) -> TypeGuard[TrainedAs]:
    return value in get_args(TrainedAs)


def resolve_mode(spec: AdapterSpec, trained_as: TrainedAs | None) -> ServedMode:
    """The mode the adapter is served in. `auto`: icarus for an adapter marked as
    ICaRus-trained, multi_lora for any other (a plain PEFT LoRA means what its weights
    compute on their own K/V). An explicit `icarus` on anything not marked icarus is
    refused in one line, since serving it would silently be a different model."""
    if spec.mode == "multi_lora":
        return "multi_lora"
    if trained_as == "icarus":
        return "icarus"
    if spec.mode == "auto":
        return "multi_lora"
    what = ("was trained as a conventional LoRA (kvrelay train lora)" if trained_as == "lora"
            else f"has no ICaRus training mark ({MARK_KEY} in {WEIGHTS_FILE})")
    raise ModelLoadError(f"adapter {spec.name!r} ({spec.path}) {what}, and icarus mode would serve it as a different "
                         f"model: retrain it with `kvrelay train icarus`, or serve it with --adapter-mode multi_lora "
                         f"(or auto)")


def resolved(spec: AdapterSpec, mode: ServedMode) -> AdapterSpec:
    """The spec with `auto` replaced by the mode it resolved to, so that whatever reads
    a served adapter's spec sees the mode it really runs in."""
    return dataclasses.replace(spec, mode=mode)
