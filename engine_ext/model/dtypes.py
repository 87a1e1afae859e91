"""The torch dtype of each name the engine's `dtype` option accepts.

Kept apart from engine_ext/config.py so the configuration imports no torch: the CLI
checks its options before the model stack loads.
"""

from __future__ import annotations

import torch

from kvrelay.engine_options import Dtype

TORCH_DTYPES: dict[Dtype, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
