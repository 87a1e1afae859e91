"""LLMEngine: admit requests, run steps, report per-request progress. Synchronous and
single-threaded by design; `AsyncEngine` drives it from a background thread."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_ext.config import EngineConfig, ModelConfig
from engine_ext.detokenizer import Detokenizer
from engine_ext.errors import CapacityError, ContextLengthError, InvalidRequestError
from engine_ext.kv import KVCache, KVCacheManager
from engine_ext.model import load_model
from engine_ext.model_runner import ModelRunner
from engine_ext.sampling import Sampler, SamplingParams
from engine_ext.scheduler import Scheduler
from engine_ext.sequence import Sequence
from engine_ext.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    delta_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int


class LLMEngine:
    def __init__(self, model_dir: Path, config: EngineConfig, model_name: str | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.model = load_model(self.model_dir, self.model_config, config.dtype)
        self.kv_cache = KVCache(self.model_config, config)
        self.kv = KVCacheManager(self.kv_cache.num_blocks, config.block_size, namespace=self.model_name)
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv, Sampler())
        limits = [self.model_config.max_position_embeddings]
        if config.max_model_len:
            limits.append(config.max_model_len)
        if self.model_config.attention_window:
            logger.warning("sliding-window model: context capped at its window of %d tokens",
                           self.model_config.attention_window)
            limits.append(self.model_config.attention_window)
        self.max_model_len = min(limits)
        eos = set(self.model_config.eos_token_ids)
        eos_from_tokenizer = self.tokenizer.token_id(self.tokenizer.eos_token)
        if eos_from_tokenizer is not None:
            eos.add(eos_from_tokenizer)
        self.eos_token_ids = frozenset(eos)

    # -- admission -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Sequence:
        """Validate and queue a request; raises InvalidRequestError subclasses."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if num_prompt >= self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {num_prompt}"
            )
        capacity = min(self.max_model_len, self.kv_cache.num_tokens)
        max_tokens = sampling.max_tokens or capacity - num_prompt
        if num_prompt + max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {num_prompt} and max_tokens asks for {max_tokens} more"
            )
        if max_tokens <= 0 or self.kv.num_blocks_for(num_prompt + max_tokens) > self.kv_cache.num_blocks:
            raise CapacityError(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) needs more KV "
                f"memory than the engine's budget of {self.kv_cache.num_tokens} tokens"
            )
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            max_tokens=max_tokens,
            detokenizer=Detokenizer(self.tokenizer, sampling.stop),
            kv_transfer_params=kv_transfer_params,
        )
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- the loop body ---------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if step.is_empty:
            return []
        sampled = self.runner.run(step)
        for seq, num_tokens in step.chunks:
            seq.num_computed_tokens += num_tokens
            self.kv.publish(seq)
        return [self._append(seq, token) for seq, token in sampled]

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        seq.token_ids.append(token)
        params = seq.sampling
        reason = None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"
        elif len(seq.output_token_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        text = seq.detokenizer.update(seq.output_token_ids, final=reason is not None)
        if text.stopped:
            reason = "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return RequestOutput(
            request_id=seq.request_id,
            delta_text=text.delta,
            new_token_ids=[token],
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=len(seq.output_token_ids),
        )

    # -- convenience for tests and benchmarks ----------------------------------------
    def generate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> Sequence:
        """Run one request to completion synchronously."""
        seq = self.add_request(f"gen-{uuid.uuid4().hex}", prompt_token_ids, sampling)
        while not seq.is_finished:
            self.step()
        return seq
