"""EngineSettings: every option of the embedded engine, from flags, environment or YAML.

It lives beside the CLI, not in engine_ext, because a gateway-only install (no engine
package, no torch) still builds the `kvrelay engine` and `kvrelay up` commands.

One list, read three ways, like the gateway's settings: `kvrelay engine` and
`kvrelay up` generate their flags from these fields (kvrelay/cli_flags.py), the
environment sets any of them as KVRELAY_ENGINE_<NAME>, and a YAML mapping named by
KVRELAY_ENGINE_CONFIG sets the rest. A flag beats a variable beats the file.

The settings are the operator's words (MiB, a method name, a comma list of layers);
`engine_config()` turns them into the engine's frozen EngineConfig, whose own checks
cover what spans several fields (a pool's prune window within its size, a disk tier
needing both a directory and a size). Each option's type, bound and choices are declared
once, in kvrelay/engine_options.py, which the engine's config uses too: the settings add
the operator's description and unit. This module imports no torch and no engine package
until a config is built, so a bad flag is refused before the model stack loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import SettingsConfigDict

from kvrelay import engine_options as option
from kvrelay.wire.plan import ReuseMethod
from kvrelay.yaml_source import YamlFileSettings

if TYPE_CHECKING:
    from engine_ext.config import AdapterSpec, EngineConfig

MiB = 2**20


class EngineSettings(YamlFileSettings):
    model_config = SettingsConfigDict(env_prefix="KVRELAY_ENGINE_", extra="forbid", frozen=True,
                                      env_ignore_empty=True)
    yaml_variable = "KVRELAY_ENGINE_CONFIG"

    model: str | None = Field(None, description="HF-format model directory (default: SmolLM2-135M-Instruct, "
                                                 "prepared on first use)")
    served_model_name: str | None = Field(None, description="model id clients send (default: the directory name)")
    # 2 GiB: about 45k tokens of SmolLM2's fp32 KV. 512 MiB (11k tokens) held less than one
    # task of a five-agent team over a long document once KVCOMM keeps each reader's offsets,
    # so the anchors were evicted before the next task could use them (docs/engine.md).
    kv_cache_mb: Annotated[option.AtLeastOne, Field(
        description="KV cache budget in MiB (stands for GPU memory)")] = 2048
    block_size: Annotated[option.BlockTokens, Field(description="tokens per KV block")] = 16
    max_num_seqs: Annotated[option.AtLeastOne, Field(description="requests running at once")] = 64
    max_num_batched_tokens: Annotated[option.AtLeastOne, Field(description="tokens computed per engine step")] = 2048
    probe_chunk_tokens: Annotated[option.AtLeastOne, Field(
        description="tokens a fidelity probe's dense score computes per step: the most a request arriving "
                    "meanwhile waits for")] = 64
    probe_idle_ms: Annotated[option.IdleMs, Field(
        description="ms without requests before a fidelity probe's dense score may take a step")] = 300.0
    max_model_len: Annotated[option.ModelLen | None, Field(description="cap on prompt + completion tokens")] = None
    dtype: Annotated[option.Dtype, Field(description="weights and KV dtype")] = "float32"
    linear_kernel: Annotated[option.LinearKernel, Field(
        description="weight products: packed (oneDNN on prepacked weights) | plain (F.linear) | int4 (decode on "
                    "4-bit Q4_1 projections and an 8-bit Q8_0 output matrix, compiled kernel; fp32 only) | auto "
                    "(int4 where those blocks store the fp32 weights exactly, as for the default GGUF model; bf16 "
                    "and fp16 packed; other fp32 timed packed vs plain at load, the faster kept)")] = "auto"
    # Reuse beyond the prefix cache.
    reuse_method: Annotated[Literal[ReuseMethod, "off"], Field(
        description="what a planned segment that names no method gets: prefix (exact: the prefix cache and its "
                    "tiers only) | dense | off, or an approximate method: blend | shift | link | kvcomm (this "
                    "engine's default for every request; through the gateway, opt in per app with its reuse rules)")
    ] = "prefix"
    blend_ratio: Annotated[option.Fraction, Field(description="blend: fraction of a segment's tokens "
                                                             "recomputed")] = 0.15
    check_layers: Annotated[str, Field(description="blend: comma-separated layers whose key deviation selects "
                                                   "the tokens")] = "1"
    link_tokens: Annotated[option.NonNegative, Field(
        description="link: tokens recomputed at the start of each segment")] = 8
    anchor_gamma: Annotated[option.Fraction, Field(description="kvcomm: entropy threshold; higher predicts "
                                                              "more samples from anchors")] = 0.3
    anchor_pool_size: Annotated[option.AtLeastOne, Field(description="kvcomm: anchors kept per placeholder")] = 20
    anchor_prune_window: Annotated[option.AtLeastOne, Field(
        description="kvcomm: a full pool drops the least used of this many oldest anchors")] = 5
    anchor_temperature: Annotated[option.Temperature, Field(
        description="kvcomm: softmax temperature over anchor distances")] = 1.0
    kvcomm_correction: Annotated[option.KvcommCorrection, Field(
        description="kvcomm: what a placed placeholder gets besides its rotation (the paper's ablation)")] = "full"
    kvcomm_new_samples: Annotated[option.KvcommNewSamples, Field(
        description="kvcomm: a sample with no anchor for this agent is placed from another reader's KV or "
                    "its prompt-computed base, an answer's first reader measuring it (readers), or predicted "
                    "from other samples' anchors (predict, the paper)")] = "readers"
    anchor_chunk_tokens: Annotated[option.AtLeastOne, Field(
        description="kvcomm: placeholders are predicted in chunks of this many tokens, each from its own "
                    "anchors")] = 16
    kvcomm_recompute_ratio: Annotated[option.RepairRatio, Field(description=(
        "kvcomm: fraction of a predicted placeholder's tokens recomputed, those whose keys deviate most on the "
        "check layers (0: offsets alone, as in the paper)"))] = 0.0
    collective: Annotated[bool, Field(description="prefill the requests of one All-Gather round together "
                                                  "(TokenDance)")] = True
    round_window_ms: Annotated[option.RoundWindowMs, Field(
        description="collective: ms a round's first request waits for its siblings")] = 0.0
    diff_store: Annotated[bool, Field(description="collective: keep a round's caches as one master and "
                                                  "block-sparse mirrors")] = True
    # Where evicted prefix-cache blocks go (KVFlow).
    kv_policy: Annotated[option.EvictionPolicyName, Field(
        description="which cached KV leaves the device first: workflow (KVFlow: the plan's steps-to-execution, "
                    "per session; exact) | lru")] = "workflow"
    host_kv_mb: Annotated[option.NonNegative | None, Field(
        description="host-memory KV tier in MiB; evicted prefixes load back from it. Default: sized at "
                    "start, twice --kv-cache-mb but at most a quarter of the memory then available "
                    "(MemAvailable); 0: none")] = None
    disk_kv_dir: str | None = Field(None, description="directory for a disk KV tier (a memory-mapped file, "
                                                      "removed on exit)")
    disk_kv_mb: Annotated[option.NonNegative, Field(description="disk KV tier size in MiB (with --disk-kv-dir)")] = 0
    load_ahead: Annotated[option.LoadAhead | None, Field(
        description="prefetch prefixes of agents this many steps from running (needs --kv-policy "
                    "workflow and a lower tier). Default: 2 with the workflow policy and a lower "
                    "tier, else 0; 0: off")] = None
    # LoRA adapters on the base model (ICaRus or multi-LoRA).
    adapter: list[str] = Field(default_factory=list, description="serve a PEFT LoRA adapter as NAME=PATH "
                                                                 "(repeat); clients ask for model 'BASE:NAME'")
    adapter_mode: Annotated[option.AdapterMode, Field(
        description="adapters: auto (icarus for adapters `kvrelay train icarus` marked, multi_lora for others) | "
                    "icarus (one shared KV cache; refuses adapters not marked as ICaRus-trained) | multi_lora")
    ] = "auto"
    adapter_first_token: Annotated[option.FirstToken, Field(
        description="icarus: sample the first token from the adapter or from the base (the paper's variant)")
    ] = "adapter"
    generic_tool_auto: Annotated[Literal["call-first", "model"], Field(
        description="tool_choice auto on a model whose chat template has no tools branch (the default SmolLM2): "
                    "call-first (an answer to a user message calls a tool; after the results the model "
                    "chooses) | model (the model always chooses)")] = "call-first"

    @field_validator("check_layers")
    @classmethod
    def _layers(cls, value: str) -> str:
        parts = [x.strip() for x in value.split(",") if x.strip()]
        if not parts or not all(p.isdigit() for p in parts):
            raise ValueError("expected comma-separated layer numbers, e.g. 1 or 0,2")
        return ",".join(parts)

    @field_validator("adapter")
    @classmethod
    def _adapters(cls, items: list[str]) -> list[str]:
        for item in items:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"{item!r}: expected NAME=PATH")
        return items

    def adapter_specs(self) -> tuple[AdapterSpec, ...]:
        from engine_ext.config import AdapterSpec

        specs = []
        for item in self.adapter:
            name, _, path = item.partition("=")
            try:
                specs.append(AdapterSpec(name, path, self.adapter_mode, self.adapter_first_token))
            except ValidationError as exc:
                raise ValueError(f"--adapter {item!r}: {_reasons(exc)}") from exc
        return tuple(specs)

    def engine_config(self) -> EngineConfig:
        """The engine's frozen configuration; raises ValueError naming what is wrong
        across fields (these fields' own bounds are checked when the settings are read)."""
        try:
            return self._engine_config()
        except ValidationError as exc:  # a check across fields
            raise ValueError(f"invalid engine settings ({exc.title}): {_reasons(exc)}") from exc

    def _engine_config(self) -> EngineConfig:
        from engine_ext.config import AnchorConfig, CollectiveConfig, EngineConfig, ReuseConfig, TierConfig

        reuse = ReuseConfig(
            enabled=self.reuse_method != "off",
            default_method="dense" if self.reuse_method == "off" else self.reuse_method,
            blend_ratio=self.blend_ratio, check_layers=tuple(int(x) for x in self.check_layers.split(",")),
            link_tokens=self.link_tokens,
            anchors=AnchorConfig(gamma=self.anchor_gamma, max_anchors=self.anchor_pool_size,
                                 prune_window=self.anchor_prune_window, temperature=self.anchor_temperature,
                                 correction=self.kvcomm_correction, chunk_tokens=self.anchor_chunk_tokens,
                                 recompute_ratio=self.kvcomm_recompute_ratio,
                                 new_samples=self.kvcomm_new_samples),
            collective=CollectiveConfig(enabled=self.collective, window_ms=self.round_window_ms,
                                        diff_store=self.diff_store))
        tiers = TierConfig(policy=self.kv_policy,
                           host_bytes=None if self.host_kv_mb is None else self.host_kv_mb * MiB,
                           disk_path=self.disk_kv_dir, disk_bytes=self.disk_kv_mb * MiB,
                           load_ahead=self.load_ahead)
        return EngineConfig(kv_cache_bytes=self.kv_cache_mb * MiB, block_size=self.block_size,
                            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            probe_chunk_tokens=self.probe_chunk_tokens, probe_idle_ms=self.probe_idle_ms,
                            max_model_len=self.max_model_len, dtype=self.dtype,
                            linear_kernel=self.linear_kernel, reuse=reuse, tiers=tiers,
                            adapters=self.adapter_specs())


def _reasons(exc: ValidationError) -> str:
    """A config's refusal in one line for the CLI (pydantic's own text spans several)."""
    return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
