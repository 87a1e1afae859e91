"""The embedded engine's option types: each option's type, bound and choices, written once.

Two modules read them: the engine's config (engine_ext/config.py, whose pydantic
dataclasses enforce them when a config is built) and the operator's settings
(kvrelay/engine_settings.py, read from flags, environment and YAML). Sharing the types,
the CLI accepts exactly what the engine accepts. This module lives beside the CLI and
imports neither torch nor the engine package, so a gateway-only install still builds the
`kvrelay engine` and `kvrelay up` commands and refuses a bad option in one line.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

Dtype = Literal["float32", "bfloat16", "float16"]
# How weight products run (engine_ext/model/linear.py): oneDNN on prepacked weights, plain
# F.linear, int4 (decode on 4-bit weights, engine_ext/model/quantize.py), or auto (int4 where
# it stores the model's weights exactly, packed for bf16/fp16; for fp32 whichever a timing
# at load finds faster).
LinearKernel = Literal["auto", "packed", "plain", "int4"]
# What KVCOMM adds to a placed placeholder (the paper's ablation): the RoPE shift alone,
# plus the placeholder offset, or plus the offset of the fixed segment that follows it.
KvcommCorrection = Literal["rotation", "placeholder", "full"]
# How KVCOMM serves a placeholder sample no anchor was measured for in this agent's prompt
# (engine_ext/kvcomm/bank.py): "readers" places it from KV some prompt computed (another
# reader's measured KV, or a base that is already a prompt's) and has an answer's first
# reader measure it; "predict" predicts its offsets from other samples' anchors (the paper).
KvcommNewSamples = Literal["readers", "predict"]
EvictionPolicyName = Literal["lru", "workflow"]
AdapterMode = Literal["auto", "icarus", "multi_lora"]
FirstToken = Literal["adapter", "base"]

AtLeastOne = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
BlockTokens = Annotated[int, Field(ge=1, le=1024)]
ModelLen = Annotated[int, Field(ge=2)]
IdleMs = Annotated[float, Field(ge=0.0, le=60_000.0)]  # waits of up to a minute
RoundWindowMs = Annotated[float, Field(ge=0.0, le=10_000.0)]
LoadAhead = Annotated[int, Field(ge=0, le=64)]
Temperature = Annotated[float, Field(gt=0.0)]
RepairRatio = Annotated[float, Field(ge=0.0, lt=1.0)]  # 1.0 would recompute all: that is dense
