"""Model and engine configuration, validated once at construction.

The engine's options (EngineConfig and the configs it holds) are pydantic dataclasses
whose fields carry their bounds and choices as the `Annotated` types of
kvrelay/engine_options.py. Those types are the options' one declaration: the operator's
settings (kvrelay/engine_settings.py, read from flags, environment and YAML) use the same
types, so a bound cannot differ between what the CLI accepts and what the engine accepts.
`__post_init__` checks only what spans several fields. No torch here (the dtype names map
to torch's in engine_ext/model/dtypes.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field
from pydantic.dataclasses import dataclass as options

from engine_ext.errors import ModelLoadError
from kvrelay.engine_options import (
    AdapterMode,
    AtLeastOne,
    BlockTokens,
    Dtype,
    EvictionPolicyName,
    FirstToken,
    Fraction,
    IdleMs,
    KvcommCorrection,
    KvcommNewSamples,
    LinearKernel,
    LoadAhead,
    ModelLen,
    NonNegative,
    RepairRatio,
    RoundWindowMs,
    Temperature,
)
from kvrelay.wire.plan import ReuseMethod


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters; only scalings that change `inv_freq` alone are accepted.

    Length-dependent scalings (dynamic NTK, YaRN, LongRoPE) make a key's rotation
    depend on the sequence length, which breaks both the paged cache and any later
    position shift of cached keys, so they are refused rather than approximated.
    """

    theta: float = 10000.0
    rope_type: Literal["default", "linear", "llama3"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ModelLoadError(f"rope_theta must be positive, got {self.theta}")
        if self.rope_type not in ("default", "linear", "llama3"):
            raise ModelLoadError(f"unsupported rope scaling {self.rope_type!r}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ModelLoadError("partial_rotary_factor must be in (0, 1]")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
        params = dict(raw.get("rope_parameters") or {})
        scaling = raw.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ModelLoadError(
                f"rope scaling {rope_type!r} depends on sequence length and is not supported"
            )
        return cls(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", 8192)
            ),
            partial_rotary_factor=float(raw.get("partial_rotary_factor", 1.0)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family decoder, read from an HF `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention only differs from full attention past the window, so
    # the engine serves such models exactly by capping the context at the window.
    attention_window: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model_type {self.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"{name} must be positive")

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """K and V of every layer for one token, at `itemsize` bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "")
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
        if act not in ("silu", "swish"):
            raise ModelLoadError(f"hidden_act {act!r} is not supported (only silu)")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            rope=RopeConfig.from_hf(raw),
            eos_token_ids=eos_ids,
            attention_window=_attention_window(raw),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ModelLoadError(f"{model_dir} has no config.json") from exc
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_hf(raw)
        except KeyError as exc:
            raise ModelLoadError(f"{path} lacks required field {exc}") from exc


def _attention_window(raw: dict[str, Any]) -> int | None:
    """The sliding window if any layer uses one (Mistral always; Qwen2/3 when enabled)."""
    window = raw.get("sliding_window")
    if not window:
        return None
    uses_window = (
        raw.get("model_type") == "mistral"
        or bool(raw.get("use_sliding_window"))
        or "sliding_attention" in (raw.get("layer_types") or ())
    )
    return int(window) if uses_window else None




@options(frozen=True)
class AnchorConfig:
    """KVCOMM's anchor pools (engine_ext/kvcomm).

    A placeholder sample is predicted from the pool when the entropy of
    softmax(-distance / temperature) over the eligible anchors is at most
    `gamma * log2(N)`; else it is computed densely and becomes an anchor. A pool keeps
    at most `max_anchors`; beyond that the least activated of its `prune_window` oldest
    anchors is dropped. Distances are L2 norms of the difference of the base values (all
    layers but the first), as in the paper; they grow with the sample's length, so long
    samples get sharper weights (a lower entropy) at the same temperature.

    Samples are chunks of at most `chunk_tokens` of a placeholder, each decided in the
    pool of its chunk position (engine_ext/kvcomm/bank.py): a new document longer than
    every anchor is still predicted, chunk by chunk.

    `new_samples`: what a sample gets when no anchor holds this agent's offsets for it.
    "readers" (the default): if another agent's prompt measured this very sample, its KV
    from there (base plus that reader's offsets); else, if its base is a prompt's KV (a
    question or document some prompt computed), the base alone, shifted; else (an answer
    as its writer generated it) it is measured, so its first reader computes it and every
    later reader is served from that. "predict": predicted from other samples' anchors
    weighed by distance, as in the paper. Measured on the long review boards, an answer
    predicted from other answers' anchors was off by 16-41% of its values against dense,
    and two readers' own KV of one answer by 2-5%.

    `recompute_ratio`: of a placeholder predicted from other samples' anchors, the share
    of tokens whose keys deviate most on the check layers is recomputed, as blend does
    (0: the paper's method, offsets alone). A placeholder reproduced from its own exact
    anchors is not: its KV is the real KV already.
    """

    gamma: Fraction = 0.3
    max_anchors: AtLeastOne = 20
    prune_window: AtLeastOne = 5
    temperature: Temperature = 1.0
    correction: KvcommCorrection = "full"
    chunk_tokens: AtLeastOne = 16
    recompute_ratio: RepairRatio = 0.0
    new_samples: KvcommNewSamples = "readers"

    def __post_init__(self) -> None:
        if self.prune_window > self.max_anchors:
            raise ValueError("anchors.prune_window must be at most anchors.max_anchors")


CollectiveRecovery = Literal["blend"]


@options(frozen=True)
class CollectiveConfig:
    """TokenDance's collective reuse of an All-Gather round (engine_ext/collective).

    Waiting requests of one round (the plan's round id) whose placed segments all use
    blend are prefilled together: their segments are shifted in one batched pass, one
    deviation pass on the check layers (over one member's prompt) selects the
    positions to recompute for every member, and the recovery method refreshes those
    positions per member in one batched forward. `window_ms` holds a round's first
    waiting request that long for its siblings (0: group only what already waits).
    Positions are selected in whole `diff_block_tokens` blocks, so after the round
    the members' caches differ from the master's in few blocks and the DiffStore
    (`diff_store`) keeps each sibling as a block-sparse mirror of one dense master.
    """

    enabled: bool = True
    window_ms: RoundWindowMs = 0.0
    max_group: Annotated[int, Field(ge=2)] = 64
    recovery: CollectiveRecovery = "blend"
    diff_block_tokens: BlockTokens = 32
    diff_store: bool = True
    # 0: lossless mirrors; above, a block within it of the master is not stored
    diff_tolerance: Annotated[float, Field(ge=0.0)] = 0.0


@options(frozen=True)
class ReuseConfig:
    """How the engine reuses a cached segment's KV away from the prompt's prefix.

    `default_method` applies to reusable segments (fixed prefixes, placeholders, shared
    blocks) whose plan names no method. The default, `prefix`, is exact: a segment is
    reused only as part of an exact prefix hit, so an answer is the answer without a
    plan. The others are approximate, for those who opt in: `shift` re-encodes
    positions only (fastest, least faithful), `blend` also recomputes the `blend_ratio` of tokens whose keys
    deviate most on `check_layers` (CacheBlend), `link` recomputes the first
    `link_tokens` tokens of each segment that follows other text (KVLink's boundary
    repair), `kvcomm` corrects placeholders with offsets learned from anchors (KVCOMM,
    see AnchorConfig), `prefix` and `dense` reuse nothing beyond exact prefix hits.
    """

    enabled: bool = True
    default_method: ReuseMethod = "prefix"
    blend_ratio: Fraction = 0.15
    check_layers: Annotated[tuple[NonNegative, ...], Field(min_length=1)] = (1,)
    link_tokens: NonNegative = 8
    min_segment_tokens: AtLeastOne = 16  # shorter segments are cheaper to compute than to track
    register_outputs: bool = True  # keep generated answers as segments for later prompts
    anchors: AnchorConfig = field(default_factory=AnchorConfig)
    collective: CollectiveConfig = field(default_factory=CollectiveConfig)




@options(frozen=True)
class AdapterSpec:
    """A LoRA adapter served on the base model, selected by `name` (engine_ext/adapters).

    `icarus`: the base model (the logical encoder) produces every K/V, so all icarus
    adapters of one base share one cache; decoding runs the base and base+adapter on
    the same token in one pass and samples from the adapter (the first token too, or
    from the base with `first_token="base"`, the paper's variant). `multi_lora`: the
    adapter produces its own K/V, cached under its own prefix namespace (vLLM's way).
    `auto` (the default): icarus for an adapter `kvrelay train icarus` marked as trained
    for it, multi_lora for any other, since only an adapter trained over the base's K/V
    is the same model in icarus mode; resolved when the adapter is loaded
    (engine_ext/adapters/marks.py), where an explicit `icarus` on an unmarked adapter
    is refused.
    """

    name: str
    path: str
    mode: AdapterMode = "auto"
    first_token: FirstToken = "adapter"

    def __post_init__(self) -> None:
        if not self.name or ":" in self.name or "/" in self.name:
            raise ValueError(f"adapter name {self.name!r} must be non-empty, without ':' or '/'")


DEFAULT_LOAD_AHEAD = 2  # KVFlow's: the agents up to two steps from running are loaded back


@options(frozen=True)
class TierConfig:
    """Where prefix-cache blocks go when the device tier (`kv_cache_bytes`) needs room,
    and which ones leave it first (engine_ext/tiers).

    Every published block is backed up on a background worker to the first lower tier:
    host memory (`host_bytes`), else a memory-mapped file (`disk_path`, `disk_bytes`);
    with both, blocks the host tier evicts move down to disk. A request whose prefix
    left the device is loaded back from a lower tier instead of recomputed. With no
    lower tier an evicted block is recomputed when next needed (plain prefix caching).

    `policy` picks the victims: `lru` (least recently used) or `workflow` (KVFlow: free
    suffixes first, then agents' fixed prefixes from the most steps-to-execution down,
    LRU among equals). `load_ahead` > 0 (workflow only) prefetches the prefixes of
    agents that many steps from running, at most `max_prefetches` agents at a time, and
    the scheduler runs other requests while a request's prefix is still loading, for
    at most `max_load_wait_ms`; after that the request goes on and recomputes the part
    that has not arrived. Steps-to-execution are kept per session (workflow instance),
    at most `workflow_max_sessions` of them, each forgotten after `workflow_idle_s`.

    The defaults are KVFlow (it never changes an output, only what is recomputed): the
    workflow policy, a host tier sized when the engine starts (`host_bytes` None:
    engine_ext/tiers/sizing.py) and `load_ahead` None, which is resolved at once to
    DEFAULT_LOAD_AHEAD under the workflow policy with a (possible) lower tier, else 0.
    `TierConfig(policy="lru", host_bytes=0)` is plain LRU prefix caching.
    """

    policy: EvictionPolicyName = "workflow"
    host_bytes: NonNegative | None = None  # None: sized when the engine starts; 0: no host tier
    disk_path: str | None = None
    disk_bytes: NonNegative = 0
    load_ahead: LoadAhead | None = None  # None: automatic (see above); an int once constructed
    max_prefetches: AtLeastOne = 4
    max_load_wait_ms: IdleMs = 2000.0
    # a session silent this long no longer ranks its agents' prefixes
    workflow_idle_s: Annotated[float, Field(gt=0.0)] = 600.0
    workflow_max_sessions: AtLeastOne = 1024  # sessions ranked at once; past it the least recently seen leaves

    def __post_init__(self) -> None:
        if (self.disk_path is None) != (self.disk_bytes == 0):
            raise ValueError("a disk tier needs both tiers.disk_path and tiers.disk_bytes > 0")
        if self.load_ahead is None:  # frozen: the automatic value is set once, here
            automatic = DEFAULT_LOAD_AHEAD if self.policy == "workflow" and self.has_lower_tier else 0
            object.__setattr__(self, "load_ahead", automatic)
        if self.load_ahead and self.policy != "workflow":
            raise ValueError("prefetching (tiers.load_ahead > 0) needs the workflow policy")
        if self.load_ahead and not self.has_lower_tier:
            raise ValueError("prefetching (tiers.load_ahead > 0) needs a host or disk tier to load from")

    @property
    def has_lower_tier(self) -> bool:
        """A host or disk tier; an automatic host tier counts (the engine turns
        prefetching off if it finds no memory to size it from)."""
        return self.host_bytes is None or self.host_bytes > 0 or self.disk_path is not None


@options(frozen=True)
class EngineConfig:
    """How the engine spends memory and compute.

    `kv_cache_bytes` stands for GPU memory: it alone decides how many KV blocks exist.
    `max_num_batched_tokens` bounds one step, so a long prefill is split into chunks
    that interleave with the decode steps of running requests. `probe_chunk_tokens`
    bounds a step of a fidelity probe's dense score (engine_ext/probes.py), and so how
    long a request arriving during it waits; such steps start only once no request has
    run for `probe_idle_ms`.
    """

    kv_cache_bytes: AtLeastOne = 512 * 2**20
    block_size: BlockTokens = 16
    max_num_seqs: AtLeastOne = 64
    max_num_batched_tokens: AtLeastOne = 2048
    probe_chunk_tokens: AtLeastOne = 64
    probe_idle_ms: IdleMs = 300.0
    max_model_len: ModelLen | None = None
    dtype: Dtype = "float32"
    linear_kernel: LinearKernel = "auto"
    num_threads: AtLeastOne | None = None
    reuse: ReuseConfig = field(default_factory=ReuseConfig)
    tiers: TierConfig = field(default_factory=TierConfig)
    adapters: tuple[AdapterSpec, ...] = ()

    def __post_init__(self) -> None:
        names = [spec.name for spec in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError("adapter names must be unique")
        if self.linear_kernel == "int4" and self.dtype != "float32":
            raise ValueError("linear_kernel int4 multiplies fp32 activations: it needs dtype float32")
