"""A decode step's layer stack as one call into the compiled library
(engine_ext/kernels/decode_forward.cpp).

At decode's few rows the module path spends more time in Python (thirty layers of module
calls, ctypes calls and fresh tensors) than the products spend streaming the weights.
`CompiledDecode` describes the model to the library once, as a table of pointers to its
norms, quantized blocks and caches, and then runs a plain decode batch (no prefill, no
adapter, no ICaRus decoder query) with one call; the embedding, the rotary angles and
the logits stay in torch. The result is bitwise the module path's: the same kernels in
the same order.

It applies to an fp32 model whose every projection has a quantized copy (`--linear-kernel
int4`, or `auto` on the default model), without q/k norms, with head sizes and GQA
groups the decode attention kernel takes; `CompiledDecode.for_model` returns None for any
other model, which keeps the module path.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, cast

import torch

from engine_ext.errors import EngineError
from engine_ext.kernels.compiled import kernels
from engine_ext.kernels.decode_attention import MAX_DIM, MAX_GROUP
from engine_ext.kernels.quant import Q4_1, Q8_0, QuantWeight
from engine_ext.model.attention import AttentionMetadata
from engine_ext.model.linear import QUANT_MAX_ROWS, PackedLinear

if TYPE_CHECKING:
    from engine_ext.model.llama import CausalLM, DecoderLayer, LayerCache

class _Linear(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int64), ("q", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("m", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("N", ctypes.c_int64), ("K", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Linear),
                ("o", _Linear), ("gate_up", _Linear), ("down", _Linear), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", ctypes.c_int64), ("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("rotary_dim", ctypes.c_int64),
                ("intermediate", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("layers", ctypes.POINTER(_Layer)), ("final_norm", ctypes.c_void_p)]


def _linear(layer: PackedLinear) -> _Linear:
    quant = layer.quant
    bias = None if layer.bias is None else layer.bias.data_ptr()
    n, k = layer.out_features, layer.in_features
    if isinstance(quant, Q4_1):
        return _Linear(0, quant.packed.data_ptr(), quant.d.data_ptr(), quant.m.data_ptr(), bias, n, k)
    assert isinstance(quant, Q8_0), "for_model admits only Q4_1 and Q8_0 copies"
    return _Linear(1, quant.q.data_ptr(), quant.d.data_ptr(), None, bias, n, k)


def _decoder_layers(model: CausalLM) -> list[DecoderLayer]:
    return cast("list[DecoderLayer]", list(model.layers))  # a ModuleList's items are typed Module


def _quantized(layer: PackedLinear) -> bool:
    quant: QuantWeight | None = layer.quant
    return isinstance(quant, (Q4_1, Q8_0)) and (layer.bias is None or layer.bias.dtype == torch.float32)


class CompiledDecode:
    """The model's decoder layers for plain decode batches, on the compiled library. The
    table points into the model's tensors: it holds while their storage does (weights are
    fixed after load; a cache is bound per call)."""

    def __init__(self, model: CausalLM) -> None:
        cfg = model.config
        self._layers = (_Layer * cfg.num_layers)()
        for entry, layer in zip(self._layers, _decoder_layers(model)):
            attn, mlp = layer.self_attn, layer.mlp
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            entry.qkv, entry.o = _linear(attn.qkv_proj), _linear(attn.o_proj)
            entry.gate_up, entry.down = _linear(mlp.gate_up_proj), _linear(mlp.down_proj)
        self._table = _Model(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.rotary_dim, cfg.intermediate_size, cfg.rms_norm_eps, cfg.head_dim**-0.5,
                             self._layers, model.norm.weight.data_ptr())
        self._slot_shape = (cfg.num_kv_heads, cfg.head_dim)  # a cache is (num_slots, kv_heads, head_dim)
        self._bound: tuple[int, ...] = ()  # the cache storage the table points at
        self._num_slots = 0

    @classmethod
    def for_model(cls, model: CausalLM) -> CompiledDecode | None:
        """The compiled decode for `model`, or None where it does not apply (see module doc)."""
        cfg = model.config
        lib = kernels()
        if lib is None or cfg.qk_norm or cfg.head_dim % 16 or cfg.head_dim > MAX_DIM:
            return None
        if cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > MAX_GROUP:
            return None
        norms = [model.norm.weight] + [n.weight for layer in _decoder_layers(model)
                                       for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        projections = [p for layer in _decoder_layers(model) for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
            return None
        if not all(_quantized(p) for p in projections):
            return None
        return cls(model)

    @staticmethod
    def applies(num_rows: int, meta: AttentionMetadata) -> bool:
        """Whether a step of `num_rows` rows is a plain decode batch the library runs."""
        return (not meta.prefills and meta.decode_slots is not None and meta.decode_lengths is not None
                and meta.decoder_entries is None and not meta.prefill_decoders
                and 0 < num_rows <= QUANT_MAX_ROWS and meta.num_kv_rows == num_rows)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[LayerCache],
                meta: AttentionMetadata) -> torch.Tensor | None:
        """x (B, hidden) the rows' embeddings, cos/sin (B, rotary_dim); returns the final
        hidden states (B, hidden), or None where the caches or the slot tensors are not the
        layout the library reads (then the modules run)."""
        if not self._bind(kv_caches):
            return None
        lib = kernels()
        assert lib is not None, "for_model checked the library"
        hidden = x.contiguous().clone()  # (B, hidden): written in place, layer by layer
        cos, sin = cos.contiguous(), sin.contiguous()
        slots, lengths = meta.decode_slots, meta.decode_lengths
        assert slots is not None and lengths is not None, "applies() checked a decode batch"
        slots, lengths, slot_mapping = slots.contiguous(), lengths.contiguous(), meta.slot_mapping.contiguous()
        if any(t.dtype != torch.int64 for t in (slots, lengths, slot_mapping)) or slots.dim() != 2:
            return None
        done = lib.kq_decode_forward(ctypes.addressof(self._table), hidden.data_ptr(), hidden.shape[0], cos.data_ptr(),
                                     sin.data_ptr(), slot_mapping.data_ptr(), slots.data_ptr(), lengths.data_ptr(),
                                     slots.shape[1], self._num_slots, torch.get_num_threads())
        if done < 0:
            raise EngineError("a decode step named a cache slot outside the cache; nothing was written")
        assert done, "for_model checked the attention shapes"
        return hidden

    def _bind(self, kv_caches: list[LayerCache]) -> bool:
        """Point the table at these caches (once per cache storage)."""
        key = tuple(t.data_ptr() for cache in kv_caches for t in cache)
        if key == self._bound:
            return True
        tensors = [t for cache in kv_caches for t in cache]
        if (len(kv_caches) != len(self._layers) or any(t.dtype != torch.float32 or not t.is_contiguous()
                                                        or t.shape != tensors[0].shape for t in tensors)
                or tensors[0].shape[1:] != self._slot_shape):
            return False
        for entry, (k_cache, v_cache) in zip(self._layers, kv_caches):
            entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        self._bound, self._num_slots = key, tensors[0].shape[0]
        return True
