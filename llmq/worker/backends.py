"""What the engine loop drives: a generation engine or an embeddings engine, behind one small
interface that speaks protocol messages (the loop adds Redis; the engines know none of it)."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from llmq.common.protocol import EngineRequest, OutputMessage
from llmq.worker.engine.embeddings import EmbeddingsScheduler
from llmq.worker.engine.sequence import LoraRef
from llmq.worker.request_error import RequestError

if TYPE_CHECKING:  # the engine loop imports this module; torch stays out of it
    from llmq.worker.llm_engine import LLMEngine, RequestOutput


class Backend(Protocol):
    kind: str
    max_batch_size: int

    def room(self) -> int:
        """How many more requests it can take now."""

    def has_unfinished(self) -> bool: ...

    def add(self, request: EngineRequest, prior_tokens: list[int]) -> None:
        """Raises RequestError for a request it cannot run."""

    def abort(self, request_id: str) -> OutputMessage | None:
        """Stop a request now; the message that ends it (None if unknown)."""

    def take(self, request_id: str) -> list[int] | None:
        """Take a request out of the engine; the tokens it generated so far, with which
        ``add`` puts it back where it was (None if unknown)."""

    def output_tokens(self, request_id: str) -> list[int] | None:
        """Every token a running request generated so far (None if unknown)."""

    def step(self) -> list[tuple[str, OutputMessage]]:
        """One step: (request id, message) for every request with news."""

    def stats(self) -> dict:
        """Heartbeat fields."""


_KIND_NAMES = {"generate": "a generation", "embed": "an embedding", "score": "a cross-encoder"}


def wrong_kind(request: EngineRequest, kind: str) -> RequestError:
    what = _KIND_NAMES.get(kind, kind)
    return RequestError(f"this worker serves {what} model; it cannot run {request.kind!r} requests")


class GenerationBackend:
    kind = "generate"

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.max_batch_size = engine.config.max_batch_size

    def room(self) -> int:
        e = self.engine
        return self.max_batch_size - e.num_running - e.num_waiting

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def add(self, request: EngineRequest, prior_tokens: list[int]) -> None:
        if request.kind != self.kind:
            raise wrong_kind(request, self.kind)
        self.engine.add_request(
            request.id,
            request.prompt_token_ids,
            request.params,
            request.priority,
            output_token_ids=prior_tokens,
            lora=LoraRef(request.lora_name, request.lora_path) if request.lora_name else None,
        )

    def abort(self, request_id: str) -> OutputMessage | None:
        out = self.engine.abort_request(request_id)
        if out is None:
            return None
        return OutputMessage(index=out.num_output_tokens, finish_reason="abort")

    def take(self, request_id: str) -> list[int] | None:
        seq = self.engine.requests.get(request_id)
        if seq is None:
            return None
        tokens = list(seq.output_token_ids)
        self.engine.abort_request(request_id)
        return tokens

    def output_tokens(self, request_id: str) -> list[int] | None:
        seq = self.engine.requests.get(request_id)
        return None if seq is None else list(seq.output_token_ids)

    def step(self) -> list[tuple[str, OutputMessage]]:
        return [(out.request_id, self._message(out)) for out in self.engine.step()]

    @staticmethod
    def _message(out: RequestOutput) -> OutputMessage:
        msg = OutputMessage(
            index=out.num_output_tokens - len(out.token_ids),
            tokens=out.token_ids,
            finish_reason=out.finish_reason.value if out.finish_reason is not None else None,
            error=out.error,
        )
        if out.logprobs:
            msg.logprobs = [
                {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top}
                for lp in out.logprobs
            ]
        msg.prompt_logprobs = out.prompt_logprobs
        if msg.finish_reason is not None and msg.error is None:
            msg.usage = {
                "prompt_tokens": out.num_prompt_tokens,
                "completion_tokens": out.num_output_tokens,
                "cached_tokens": out.num_cached_tokens,
            }
        return msg

    def stats(self) -> dict:
        e = self.engine
        bm = e.block_manager
        return {
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "running": e.num_running,
            "waiting": e.num_waiting,
            "steps_total": e.num_steps,
            "tokens_total": e.num_generated,
            "requests_total": e.num_requests_total,
            "prefix_cache_hit_tokens": bm.prefix_hits,
            "preemptions_total": e.scheduler.num_preemptions,
            "pending_tokens": sum(bm.tokens_to_compute(s) for s in e.requests.values()),
            "block_size": bm.block_size if bm.enable_prefix_caching else 0,
            "loras": e.loras.names() if e.loras is not None else "",
            **spec_counts(e),
        }

    def cached_block_hashes(self) -> list[int]:
        """The block hashes its prefix cache holds (published for placement)."""
        return list(self.engine.block_manager.cached_hashes())


def spec_counts(engine: LLMEngine) -> dict[str, int]:
    """The heartbeat's speculative decoding totals (zeros where it is off)."""
    if engine.speculator is None:
        return {}
    s = engine.speculator.stats
    return {"spec_verified": s.verified, "spec_proposed": s.proposed, "spec_accepted": s.accepted}


@dataclass(slots=True)
class _PendingEmbedding:
    request: EngineRequest
    vectors: list[str | None]
    remaining: int
    prompt_tokens: int
    dimensions: int | None = None
    extra: dict = field(default_factory=dict)


class EmbeddingBackend:
    """Batches the inputs of embedding requests (sorted by length to cut padding) through an
    encoder; answers each request once all its inputs are done."""

    kind = "embed"
    # On a CPU a step costs about its padded tokens: keep batches at least this full (real
    # tokens over padded ones), which raises throughput (docs/performance.md, "Embeddings").
    # On CUDA padding is nearly free next to a step's fixed cost: no floor.
    cpu_min_efficiency = 0.75

    def __init__(self, runner, max_batch_size: int, max_batch_tokens: int, max_model_len: int):
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        device = getattr(runner, "device", None)
        on_cpu = device is not None and getattr(device, "type", device) == "cpu"
        self.scheduler = EmbeddingsScheduler(
            max_batch_size,
            max(max_batch_tokens, max_model_len),
            min_efficiency=self.cpu_min_efficiency if on_cpu else 0.0,
        )
        self.pending: dict[str, _PendingEmbedding] = {}
        self.num_steps = 0
        self.num_inputs = 0
        self.num_requests_total = 0

    def room(self) -> int:
        # A request may hold hundreds of inputs: take no more while a backlog waits.
        if self.scheduler.num_waiting >= self.max_batch_size * 4:
            return 0
        return max(0, self.max_batch_size - len(self.pending))

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def add(self, request: EngineRequest, prior_tokens: list[int]) -> None:
        if request.kind != self.kind:
            raise wrong_kind(request, self.kind)
        inputs = request.inputs or []
        if not inputs:
            raise RequestError("an embedding request needs at least one input")
        for i, ids in enumerate(inputs):
            if not ids:
                raise RequestError(f"input[{i}] is empty")
            if len(ids) > self.max_model_len:
                raise RequestError(
                    f"input[{i}] has {len(ids)} tokens; this model takes at most {self.max_model_len}"
                )
            if any(not 0 <= t < self.runner.vocab_size for t in ids):
                raise RequestError(
                    f"input[{i}]: token ids must be in [0, {self.runner.vocab_size})"
                )
        dims = request.options.get("dimensions")
        if dims is not None and not 0 < int(dims) <= self.runner.dimensions:
            raise RequestError(f"dimensions must be between 1 and {self.runner.dimensions}")
        self.pending[request.id] = _PendingEmbedding(
            request, [None] * len(inputs), len(inputs), sum(map(len, inputs)), dims
        )
        self.num_requests_total += 1
        for i, ids in enumerate(inputs):
            self.scheduler.add(request.id, i, len(ids))

    def abort(self, request_id: str) -> OutputMessage | None:
        if self.pending.pop(request_id, None) is None:
            return None
        self.scheduler.remove(request_id)
        return OutputMessage(index=0, finish_reason="abort")

    def take(self, request_id: str) -> list[int] | None:
        """An embedding request has no tokens: put back, it starts over."""
        return None if self.abort(request_id) is None else []

    def output_tokens(self, request_id: str) -> list[int] | None:
        return None

    def step(self) -> list[tuple[str, OutputMessage]]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        vectors = self._run(batch)
        self.num_steps += 1
        self.num_inputs += len(batch)
        done: list[tuple[str, OutputMessage]] = []
        for item, vec in zip(batch, vectors, strict=True):
            p = self.pending[item.request_id]
            if p.dimensions:
                vec = self.runner.truncate(vec, p.dimensions)
            p.vectors[item.index] = base64.b64encode(vec.numpy().astype("<f4").tobytes()).decode()
            p.remaining -= 1
            if p.remaining == 0:
                del self.pending[item.request_id]
                done.append(
                    (
                        item.request_id,
                        OutputMessage(
                            index=0,
                            finish_reason="stop",
                            embeddings=p.vectors,
                            usage={"prompt_tokens": p.prompt_tokens, "completion_tokens": 0},
                        ),
                    )
                )
        return done

    def _run(self, batch) -> list:
        """The batch's vectors, in its order."""
        return self.runner.embed(
            [self.pending[it.request_id].request.inputs[it.index] for it in batch]
        )

    def stats(self) -> dict:
        return {
            "kv_blocks_total": 0,
            "kv_blocks_used": 0,
            "running": len(self.pending),
            "waiting": self.scheduler.num_waiting,
            "steps_total": self.num_steps,
            "tokens_total": self.num_inputs,
            "requests_total": self.num_requests_total,
            "dimensions": self.runner.dimensions,
            "matryoshka": int(self.runner.matryoshka),
        }
