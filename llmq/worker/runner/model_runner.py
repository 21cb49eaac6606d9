"""The only code that runs the model: one forward pass per engine step over a packed ragged
batch, with attention reading and writing the paged KV pool; logits only where a token is
sampled.

Per step the runner builds, once, everything the attention layers need: the cache slot of every
new token, the decodes' block tables and masks (decodes sorted by context length and cut into a
few chunks of similar length, so little padding is gathered, or, for the C++ kernel, their
padded block tables) and the prefill chunks' masks.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

from llmq.worker.engine.kv_groups import KVLayout
from llmq.worker.engine.scheduler import SchedulerOutput
from llmq.worker.engine.sequence import LoraRef
from llmq.worker.runner import cpu_kernels
from llmq.worker.runner.attention.paged import (
    ATTN_IMPLEMENTATION,
    KVPool,
    StepMetadata,
)
from llmq.worker.runner.attention.step_metadata import StepBuilder
from llmq.worker.runner.forward.decoder_forward import (
    build_forward,
    supports,
    take_attached,
)
from llmq.worker.runner.forward.model_support import ModelFeatures, model_dims, pool_dims
from llmq.worker.runner.forward.plan import ForwardPlan
from llmq.worker.runner.lora.lora_linear import step_adapters
from llmq.worker.runner.lora.lora_weights import AdapterWeights
from llmq.worker.runner.malloc_tuning import tune_malloc
from llmq.worker.runner.packed_batch import PackedBatch, PromptRows, pack_step
from llmq.worker.runner.spare_cores import SpareCores

log = logging.getLogger(__name__)

__all__ = ["ModelRunner", "model_dims", "pool_dims"]

# CPU steps of fewer tokens than this are latency-bound matrix-vector products. Unpacked, they
# run on one thread: F.linear's do not pay for waking a second one (one stream 31 tok/s on one
# thread, 22 on two, on 2 cores). Packed oneDNN weights scale (a 1-12 token step 10-20% faster
# on two threads), so they run on ``small_step_threads``: `llmq up` gives its single-threaded
# CPU workers all the cores for these, taken only where the rest of the machine leaves them
# idle (a lone stream: 16 ms a token instead of 18-20 on 2 cores).
SMALL_STEP_TOKENS = 16
# The kernel's vectors hold 16 floats (AVX-512; 8 with AVX2): head dims of 64 and 128 qualify.
KERNEL_HEAD_DIM_MULTIPLE = 16


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        fast_forward: bool = True,
        pack_weights: bool = True,
        small_step_threads: int | None = None,
        cuda_graphs: bool = False,
        use_kernels: bool = True,
        max_batch_size: int = 64,
        max_model_len: int = 2048,
        features: ModelFeatures | None = None,
        layout: KVLayout | None = None,
        kv_cache_dtype: str = "auto",
    ):
        """``features``: what the model's attention needs (``model_support.inspect_model``);
        None: nothing beyond causal softmax attention. ``layout``: KV groups (sliding windows)."""
        self.layout = layout
        # A vision-language model's image runtime (``worker/vision``), set by its backend.
        self.vision = None
        self._take_features(features or ModelFeatures(), max_model_len)
        self.small_step_threads = small_step_threads
        self._spare_cores = SpareCores(len(os.sched_getaffinity(0)))
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.block_size = block_size
        if self.device.type == "cpu":
            tune_malloc()
        # Graphs attend as for a plain model: none where it asks more.
        plain = fast_forward and supports(model) and not self.featured and layout is None
        # They write the cache in the model's dtype: none over an 8-bit one (kv_quant.py).
        plain = plain and kv_cache_dtype == "auto"
        self.kv_cache_dtype = kv_cache_dtype
        use_graphs = cuda_graphs and self.device.type == "cuda" and plain
        # One extra block that no sequence owns: graphs pad their batches into it, and tokens
        # whose KV is already cached write theirs there (see pack_step).
        self.scratch_slot = num_blocks * block_size
        self.pool = self._make_pool(num_blocks + 1, features)
        # This changes the config in place: never share it with a reference model.
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        kernels = use_kernels and self.device.type == "cpu" and cpu_kernels.load()
        self._build_forward(fast_forward, pack_weights, kernels)
        self.graphs = None
        if use_graphs:
            from llmq.worker.runner.forward.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(
                self.forward, self.pool, num_blocks, max_batch_size, max_model_len
            )
        self.decode_kernel = self._use_kernels(kernels, self.pool.head_dim)
        self.plan = self._decide_plan()
        self.steps = self._step_builder(max_model_len)

    def _decide_plan(self) -> ForwardPlan:
        """The forward's plan (``forward/plan.py``), from what was built; logged once."""
        forward = self.forward
        fused = forward is not None and forward.fused_step_serves(self.pool.quantized)
        if forward is not None:
            forward.fused_step = fused
        plan = ForwardPlan(
            forward="llmq" if forward is not None else "transformers",
            weights=forward.layout if forward is not None else "plain",
            layer_ops="cpp" if forward is not None and forward.small_step_ops else "torch",
            fused_step=fused,
            decode_attention="cpp" if self.decode_kernel else "torch",
            cuda_graphs=self.graphs is not None,
        )
        log.info("forward plan: %s", plan.describe())
        return plan

    def _step_builder(self, max_model_len: int) -> StepBuilder:
        """Each step's attention metadata, built once per step (``step_metadata.py``)."""
        return StepBuilder(
            self.pool,
            self.dtype,
            self.device,
            self.block_size,
            self.windows,
            self.featured,
            max_model_len,
            self.scratch_slot,
            self.layout,
        )

    def _build_forward(self, fast_forward: bool, pack_weights: bool, kernels: bool) -> None:
        """llmq's forward (or None: transformers'), built here unless one was built ahead."""
        model, started = self.model, time.monotonic()
        attached = take_attached(model)
        self.forward = attached or build_forward(model, fast_forward, pack_weights, kernels)
        if attached is None:  # its weights read and packed for the kernels: a GGUF's from the file
            log.info("load phase: forward built in %.2f s", time.monotonic() - started)
        log.info(
            "model runner: %s forward%s",
            "llmq's lean decoder" if self.forward is not None else "transformers'",
            f", weights packed ({self.forward.layout})"
            if self.forward is not None and self.forward.packed
            else "",
        )

    def _make_pool(self, num_blocks: int, features: ModelFeatures | None) -> KVPool:
        """The KV pool: a block holds every layer's keys and values, or one KV group's."""
        dims = pool_dims(self.model.config, features)
        slots = self.layout.layer_slots() if self.layout else None
        return KVPool(
            *dims, num_blocks, self.block_size, self.dtype, self.device, slots, self.kv_cache_dtype
        )

    def _take_features(self, features: ModelFeatures, max_model_len: int) -> None:
        self.features = features
        self.max_model_len = max_model_len
        # Sliding windows shorter than the context: their masks are built every step.
        self.windows = features.effective_windows(max_model_len)
        # Layers that need more than causal attention: every prefill gets a mask; decodes take
        # the kernel with the layer's features, else the gathered path with the window masks.
        self.featured = features.needs_kernel_features(max_model_len) or features.mla

    def _use_kernels(self, loaded: bool, head_dim: int) -> bool:
        """Turn on llmq's C++ kernels where they serve (``loaded``): the small steps' ops in the
        forward; whether the decode attention kernel runs."""
        if self.forward is not None:
            self.forward.small_step_ops = loaded
        attention = loaded and head_dim % KERNEL_HEAD_DIM_MULTIPLE == 0
        log.info(
            "model runner: decode attention by %s",
            "llmq's C++ kernel" if attention else "torch (gather, batched matmuls)",
        )
        return attention

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, adapters: Mapping[LoraRef, AdapterWeights] | None = None
    ) -> tuple[torch.Tensor, list[int], list[PromptRows]]:
        """Run one step. Returns float32 logits, one row per sampling entry, then the rows of
        the prompts that want prompt logprobs; the indices of the sampling entries in
        ``out.scheduled``; and those prompts' rows, in order. ``adapters``: the loaded LoRA
        adapters, for the sequences that name one (a step with any runs no CUDA graph)."""
        # The decode kernel reads the decodes in any order: those of one adapter together.
        batch = pack_step(out.scheduled, self.block_size, self.scratch_slot, self.decode_kernel)
        if self.vision is not None and self.vision.rows(batch):
            return self._run_packed(batch)  # image rows: their embeddings replaced
        lora = None
        if adapters:
            lora = step_adapters(batch, adapters, self.forward.loras.slots)
        if lora is not None:
            with self.forward.loras.applying(lora):
                return self._run_packed(batch)
        tables = [item.seq.block_table for item in batch.decodes]
        if self._fits_graphs(batch):
            positions = self._decode_positions(batch)
            logits = self.graphs.run(batch.input_ids, positions, batch.slots, tables)
            return logits.float(), batch.sampled_entries, []
        return self._run_packed(batch)

    def _run_packed(self, batch: PackedBatch) -> tuple[torch.Tensor, list[int], list[PromptRows]]:
        meta = self.steps.build(batch, self.decode_kernel and bool(batch.decodes))
        keep_rows = torch.tensor(batch.keep, dtype=torch.long, device=self.device)
        images = self.vision.rows(batch) if self.vision is not None else None
        with self._threads_for(len(batch.input_ids)):
            if images:
                logits = self.vision.forward(
                    self.model, batch, images, keep_rows, meta, self.forward
                )
            else:
                positions = self.vision.positions(batch) if self.vision is not None else None
                logits = self._forward(batch.input_ids, batch.positions, keep_rows, meta, positions)
        return logits.float(), batch.sampled_entries, batch.prompt_rows

    def _fits_graphs(self, batch: PackedBatch) -> bool:
        """Whether a captured CUDA graph runs this step: decodes only, in a captured batch and
        context bucket."""
        return (
            self.graphs is not None
            and self._decode_only(batch)
            and self.graphs.fits(
                len(batch.decodes), -(-(batch.positions[-1] + 1) // self.block_size)
            )
        )

    def _decode_positions(self, batch: PackedBatch) -> list[int]:
        """A decode-only step's rows' positions: their indices, or with M-RoPE each row's index
        plus its request's shift (a decode row's three positions are one)."""
        rope = self.vision.positions(batch) if self.vision is not None else None
        return batch.positions if rope is None else rope[0, 0].tolist()

    @staticmethod
    def _decode_only(batch: PackedBatch) -> bool:
        """Decodes only, every one sampling (no prompt logprobs)."""
        decodes = batch.decodes
        return bool(decodes) and not batch.prefills and len(batch.keep) == len(decodes)

    @contextmanager
    def _threads_for(self, num_tokens: int) -> Iterator[None]:
        """torch's intra-op threads for a step of ``num_tokens`` tokens, restored after it."""
        threads = torch.get_num_threads()
        step_threads = threads
        if self.device.type == "cpu":
            step_threads = self._step_threads(num_tokens, threads)
        if step_threads != threads:
            torch.set_num_threads(step_threads)
        try:
            yield
        finally:
            if step_threads != threads:
                torch.set_num_threads(threads)

    def _step_threads(self, num_tokens: int, threads: int) -> int:
        """Threads for a CPU step: the worker's own, but small steps (latency-bound) follow
        their own rule."""
        if num_tokens >= SMALL_STEP_TOKENS:
            return threads
        if self.forward is None or not self.forward.packed:
            return 1
        wanted = self.small_step_threads or threads
        if wanted > threads:
            # More than its own share: only cores the rest of the machine leaves idle, counting
            # a core that is idle three quarters of the time (the API and Redis come and go).
            extra = int(self._spare_cores.spare() - threads + 0.75)
            wanted = max(threads, min(wanted, threads + extra))
        return wanted

    def _forward(
        self,
        input_ids: list[int],
        positions: list[int],
        keep_rows: torch.Tensor,
        meta: StepMetadata,
        rope: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rope``: the rows' M-RoPE positions [3, 1, rows] (llmq's forward builds each row's
        cos and sin from its three; transformers' takes them as they are)."""
        dev = self.device
        if self.forward is not None:
            rows = torch.tensor(positions) if rope is None else rope[:, 0]
            logits = self.forward(
                torch.tensor(input_ids, device=dev),
                rows.to(dev),
                keep_rows,
                meta,
            )
        else:
            position_ids = torch.tensor([positions]) if rope is None else rope
            logits = self.model(
                input_ids=torch.tensor([input_ids], device=dev),
                position_ids=position_ids.to(dev),
                use_cache=False,
                logits_to_keep=keep_rows,
                llmq_step=meta,
            ).logits[0]
        return logits
