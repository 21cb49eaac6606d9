"""The engine facade: add requests, abort them, step. Ties the pure scheduler and block manager
to the torch model runner and sampler; knows nothing of Redis."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmq.common.model_loader import resolve_device
from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.block_manager import BlockManager
from llmq.worker.engine.scheduler import Scheduler
from llmq.worker.engine.sequence import FinishReason, Sequence
from llmq.worker.request_error import RequestError
from llmq.worker.runner.sampler import Sampler, TokenLogprobs

if TYPE_CHECKING:
    from llmq.common.settings import Settings

log = logging.getLogger(__name__)


# On a CPU a step's time grows with its tokens: 128 prompt tokens beside the decodes cut the
# 32-stream ITL p99 from 0.76-0.97 s to 0.27-0.29 s (`bench/compare.py`, 2 cores), with the
# same output and a lower TTFT p50. A GPU step of 512 tokens is hardly longer than one of 128.
CPU_PREFILL_TOKENS_WITH_DECODES = 128


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    max_batch_size: int = 64
    max_batch_tokens: int = 512
    max_prefill_tokens_with_decodes: int | None = None  # None: max_batch_tokens
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    fast_forward: bool = True  # llmq's lean decoder forward where the architecture allows
    pack_weights: bool = True  # bfloat16 on CPU: projection weights packed for oneDNN
    small_step_threads: int | None = None  # CPU steps of few tokens; None: the worker's
    cuda_graphs: bool = True  # decode-only steps on CUDA replayed from captured graphs

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        return cls(
            block_size=settings.block_size,
            num_blocks=settings.kv_blocks,
            kv_cache_memory_gb=settings.kv_cache_memory_gb,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            max_prefill_tokens_with_decodes=settings.max_prefill_tokens_with_decodes
            or (
                CPU_PREFILL_TOKENS_WITH_DECODES
                if resolve_device(settings.device) == "cpu"
                else None
            ),
            max_model_len=settings.max_model_len,
            enable_prefix_caching=settings.enable_prefix_caching,
            fast_forward=settings.fast_forward,
            pack_weights=settings.pack_weights,
            small_step_threads=settings.small_step_threads,
            cuda_graphs=settings.cuda_graphs,
        )


def _kv_pool_size(model, config: EngineConfig) -> tuple[int, int]:
    """(KV blocks, longest sequence in tokens) for ``model`` under ``config``."""
    from llmq.worker.runner.attention import KVPool
    from llmq.worker.runner.model_runner import model_dims

    text_config = model.config.get_text_config()
    num_blocks = config.num_blocks
    if num_blocks is None:
        dtype = next(model.parameters()).dtype
        per_block = KVPool.bytes_per_block(*model_dims(model.config), config.block_size, dtype)
        num_blocks = max(1, int(config.kv_cache_memory_gb * 2**30) // per_block)
    model_limit = getattr(text_config, "max_position_embeddings", None) or 2048
    max_len = min(config.max_model_len or model_limit, model_limit)
    if config.num_blocks is None:
        # Past twice what a full batch of full-length sequences needs, blocks only feed
        # the prefix cache; don't spend the whole budget on a small model.
        full = config.max_batch_size * -(-max_len // config.block_size)
        num_blocks = min(num_blocks, 2 * full)
    # One sequence alone must always fit, or it could preempt itself forever.
    return num_blocks, min(max_len, num_blocks * config.block_size)


@dataclass(slots=True)
class RequestOutput:
    """One step's news for one request."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    def __init__(self, model, config: EngineConfig | None = None, eos_token_ids=frozenset()):
        from llmq.worker.runner.model_runner import ModelRunner

        config = config or EngineConfig()
        self.config = config
        self.model = model
        self.vocab_size = model.config.get_text_config().vocab_size
        num_blocks, self.max_model_len = _kv_pool_size(model, config)
        self.num_blocks = num_blocks
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_batch_size=config.max_batch_size,
            max_batch_tokens=max(config.max_batch_tokens, config.max_batch_size),
            max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids,
            max_prefill_tokens_with_decodes=config.max_prefill_tokens_with_decodes,
        )
        self.runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            fast_forward=config.fast_forward,
            pack_weights=config.pack_weights,
            small_step_threads=config.small_step_threads,
            cuda_graphs=config.cuda_graphs,
            max_batch_size=config.max_batch_size,
            max_model_len=self.max_model_len,
        )
        self.sampler = Sampler(eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self._arrivals = 0
        self.num_steps = 0
        self.num_generated = 0
        self.num_requests_total = 0
        log.info(
            "engine: %d KV blocks of %d tokens, max_model_len %d, batch %d seqs / %d tokens",
            num_blocks,
            config.block_size,
            self.max_model_len,
            config.max_batch_size,
            config.max_batch_tokens,
        )

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        output_token_ids: list[int] | None = None,
    ) -> Sequence:
        """Queue a request. ``output_token_ids``: tokens it already generated elsewhere
        (resuming after a worker died); generation continues after them."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request {request_id!r} is already running")
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        tokens = list(prompt_token_ids) + list(output_token_ids or [])
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise RequestError(f"token ids must be in [0, {self.vocab_size})")
        if len(tokens) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(tokens)} tokens; this model's context is {self.max_model_len}"
            )
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params,
            priority=priority,
            arrival=self._arrivals,
            output_token_ids=list(output_token_ids or []),
        )
        self._arrivals += 1
        self.num_requests_total += 1
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks are free when this returns."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.abort(seq)
        return self._output(seq, [], seq.finish_reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out:
            return []
        logits, entries = self.runner.execute(out)
        seqs = [out.scheduled[i].seq for i in entries]
        sampled = self.sampler(logits, seqs) if seqs else None
        tokens: list[int | None] = [None] * len(out.scheduled)
        logprobs: dict[int, TokenLogprobs | None] = {}
        for row, i in enumerate(entries):
            tokens[i] = sampled.token_ids[row]
            logprobs[id(out.scheduled[i].seq)] = sampled.logprobs[row]
        updates = self.scheduler.update(out, tokens)
        self.num_steps += 1
        self.num_generated += len(updates)
        outputs = []
        for u in updates:
            lp = logprobs.get(id(u.seq))
            outputs.append(self._output(u.seq, [u.token_id], u.finish_reason, lp))
            if u.finish_reason is not None:
                self.requests.pop(u.seq.request_id, None)
        return outputs

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion; their output token ids, in order. For tests and tools."""
        ids = [f"gen-{self._arrivals + i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, params)
        results: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                results[o.request_id].extend(o.token_ids)
        return [results[rid] for rid in ids]

    @staticmethod
    def _output(seq: Sequence, tokens, reason, logprobs=None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            finish_reason=reason,
            logprobs=[logprobs] if logprobs is not None else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )
