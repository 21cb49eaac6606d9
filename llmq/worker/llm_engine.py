"""The engine facade: add requests, abort them, step. Ties the pure scheduler and block manager
to the torch model runner and sampler; knows nothing of Redis."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmq.common.protocol import EngineError
from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.scheduler import Scheduler, SchedulerOutput
from llmq.worker.engine.sequence import FinishReason, LoraRef, Sequence, SequenceStatus
from llmq.worker.kv_setup import block_manager, kv_pool_and_layout, served_features
from llmq.worker.loading.model_loader import resolve_device
from llmq.worker.lora_pool import LoraPool
from llmq.worker.request_error import RequestError
from llmq.worker.runner.prompt_logprobs import reduce_prompt_rows
from llmq.worker.runner.sampler import Sampler, TokenLogprobs
from llmq.worker.spec.config import SpecConfig
from llmq.worker.spec.speculator import Speculator

if TYPE_CHECKING:
    from llmq.common.settings import Settings
    from llmq.worker.constrained_sequences import ConstrainedSequences

log = logging.getLogger(__name__)


# On a CPU a step's time grows with its tokens: 128 prompt tokens beside the decodes cut the
# 32-stream ITL p99 from 0.76-0.97 s to 0.27-0.29 s (`bench/compare.py`, 2 cores), with the
# same output and a lower TTFT p50. A GPU step of 512 tokens is hardly longer than one of 128.
CPU_PREFILL_TOKENS_WITH_DECODES = 128
# How long an otherwise idle step waits for a grammar being built (a build finishing sooner
# ends the wait): the engine loop pulls new requests and cancels between steps.
GRAMMAR_WAIT_S = 0.05


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None  # None: sized to the batch (engine/kv_sizing.py)
    kv_cache_dtype: str = (
        "auto"  # int8 or fp8: 8-bit codes and scales (runner/attention/kv_quant.py)
    )
    max_batch_size: int = 64
    max_batch_tokens: int = 512
    max_prefill_tokens_with_decodes: int | None = None  # None: max_batch_tokens
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    prefix_cache_share: float | None = 1.0  # CPU (pool resident as written); see BlockManager
    fast_forward: bool = True  # llmq's lean decoder forward where the architecture allows
    pack_weights: bool = True  # bfloat16 on CPU: projection weights packed for oneDNN
    small_step_threads: int | None = None  # CPU steps of few tokens; None: the worker's
    cuda_graphs: bool = True  # decode-only steps on CUDA replayed from captured graphs
    cpu_kernels: bool = True  # llmq's C++ kernels on CPU (decode attention, small steps)
    max_loras: int = 8  # LoRA adapters loaded at once
    max_lora_rank: int = 64
    speculative: SpecConfig | None = None  # None: no speculative decoding

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        return cls(
            block_size=settings.block_size,
            num_blocks=settings.kv_blocks,
            kv_cache_memory_gb=settings.kv_cache_memory_gb,
            kv_cache_dtype=settings.kv_cache_dtype,
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
            prefix_cache_share=settings.prefix_cache_share,
            fast_forward=settings.fast_forward,
            pack_weights=settings.pack_weights,
            small_step_threads=settings.small_step_threads,
            cuda_graphs=settings.cuda_graphs,
            cpu_kernels=settings.cpu_kernels,
            max_loras=settings.max_loras,
            max_lora_rank=settings.max_lora_rank,
            speculative=SpecConfig.from_settings(settings),
        )


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
    # With the first output of a request that asked: None for token 0, then per prompt token
    # {token_id, logprob, rank, top: [[id, logprob], ...]}.
    prompt_logprobs: list[dict | None] | None = None
    error: EngineError | None = None  # the request failed (its grammar): finish_reason abort

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    def __init__(
        self,
        model,
        config: EngineConfig | None = None,
        eos_token_ids=frozenset(),
        tokenizer=None,
    ):
        """``tokenizer``: the served tokenizer (or a ``grammar_compiler.LazyTokenizer``), for
        requests constrained by a grammar (without one the engine refuses them)."""
        from llmq.worker.runner.model_runner import ModelRunner

        config = config or EngineConfig()
        self.config = config
        self.model = model
        self.vocab_size = model.config.get_text_config().vocab_size
        features = served_features(model)
        pool, self.kv_layout = kv_pool_and_layout(model, config, features)
        self.num_blocks = num_blocks = pool.num_blocks
        self.max_model_len = pool.max_model_len
        self.runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            fast_forward=config.fast_forward,
            pack_weights=config.pack_weights,
            small_step_threads=config.small_step_threads,
            cuda_graphs=config.cuda_graphs,
            use_kernels=config.cpu_kernels,
            max_batch_size=config.max_batch_size,
            max_model_len=self.max_model_len,
            features=features,
            layout=self.kv_layout,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        self.block_manager = block_manager(
            config, num_blocks, self.kv_layout, self.runner.pool.lazily_resident
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_batch_size=config.max_batch_size,
            max_batch_tokens=max(config.max_batch_tokens, config.max_batch_size),
            max_model_len=self.max_model_len,
            eos_token_ids=eos_token_ids,
            max_prefill_tokens_with_decodes=config.max_prefill_tokens_with_decodes,
        )
        self.sampler = Sampler(eos_token_ids)
        self.speculator = _speculator(self, tokenizer)
        self.constrained = (
            _constrained_sequences(tokenizer, self.vocab_size, eos_token_ids, config)
            if tokenizer is not None
            else None
        )
        self.loras: LoraPool | None = None  # made with the first request for an adapter
        self.requests: dict[str, Sequence] = {}
        self._arrivals = 0
        self.num_steps = 0
        self.num_generated = 0
        self.num_requests_total = 0
        self._log_config(pool.reason)

    def _log_config(self, pool_reason: str) -> None:
        config = self.config
        log.info(
            "engine: %d KV blocks of %d tokens (%.2f GiB, %s), sized by %s; "
            "max_model_len %d, batch %d seqs / %d tokens",
            self.num_blocks,
            config.block_size,
            self.runner.pool.nbytes / 2**30,
            "resident as it is used" if self.runner.pool.lazily_resident else "resident",
            pool_reason,
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
        lora: LoraRef | None = None,
    ) -> Sequence:
        """Queue a request. ``output_token_ids``: tokens it already generated elsewhere
        (resuming after a worker died); generation continues after them. ``lora``: the LoRA
        adapter applied to it (loaded first where it is not)."""
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
        if params.grammar is not None and self.constrained is None:
            raise RequestError("this worker cannot run constrained requests (no tokenizer)")
        if lora is not None and self.loras is None:
            self.loras = LoraPool.for_runner(self.runner, self.config)
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params,
            priority=priority,
            arrival=self._arrivals,
            output_token_ids=list(output_token_ids or []),
            lora=lora,
            hash_root=self.loras.hash_root(lora) if lora is not None else 0,
        )
        self._arrivals += 1
        self.num_requests_total += 1
        self.requests[request_id] = seq
        if lora is None or self.loras.add(seq):  # else it waits for its adapter
            self._enter(seq)
        return seq

    def _enter(self, seq: Sequence) -> None:
        if seq.params.grammar is not None:
            self.constrained.add(seq)  # it enters the scheduler once its matcher is built
        else:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks are free when this returns."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        if self.speculator is not None:
            self.speculator.forget(seq)
        if self._discard(seq):  # it was still waiting for its adapter or its matcher
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
        else:
            self.scheduler.abort(seq)
        return self._output(seq, [], seq.finish_reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._num_building > 0

    @property
    def _num_building(self) -> int:
        """Requests waiting for their grammar's matcher or their adapter."""
        grammars = len(self.constrained.pending) if self.constrained is not None else 0
        return grammars + (len(self.loras.pending) if self.loras is not None else 0)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + self._num_building

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        failed = self._admit_waiting() if self._num_building else []
        if self.speculator is not None:
            self.speculator.prepare(self.scheduler.running)
            if self.constrained is not None and self.constrained.matchers:
                from llmq.worker.spec.constrained import trim_drafts  # llguidance: when used

                trim_drafts(self.constrained.matchers, self.scheduler.running)
        out = self.scheduler.schedule()
        if not out:
            if self._num_building and not failed:
                self._wait_for_builds()
            return failed
        if self.speculator is None:
            return failed + self._run(out)
        start = time.perf_counter()
        outputs = self._run(out)
        if all(s.num_new_tokens == 1 + len(s.draft) for s in out.scheduled):
            self.speculator.observe(out.num_tokens, time.perf_counter() - start)
        return failed + outputs

    def _run(self, out: SchedulerOutput) -> list[RequestOutput]:
        """Run one scheduled step and sample its tokens."""
        if self.loras is not None and self.loras.resident:
            logits, entries, prompt_rows = self.runner.execute(out, self.loras.resident)
        else:
            logits, entries, prompt_rows = self.runner.execute(out)
        if prompt_rows:
            reduce_prompt_rows(logits[len(entries) :], prompt_rows)
            logits = logits[: len(entries)]
        if self.speculator is not None and any(s.draft for s in out.scheduled):
            return self._verify_drafts(out, logits, entries)
        seqs = [out.scheduled[i].seq for i in entries]
        mask = None
        if self.constrained is not None and self.constrained.matchers:
            mask = self.constrained.mask(seqs)
        sampled = self.sampler(logits, seqs, mask) if seqs else None
        tokens: list[int | None] = [None] * len(out.scheduled)
        logprobs: dict[int, list[TokenLogprobs | None]] = {}
        for row, i in enumerate(entries):
            tokens[i] = sampled.token_ids[row]
            logprobs[id(out.scheduled[i].seq)] = sampled.logprobs[row : row + 1]
        grammar = None
        if mask is not None:
            grammar = self.constrained.advance(seqs, sampled.token_ids, mask.rows)
        updates = self.scheduler.update(out, tokens, grammar.complete if grammar else ())
        return self._outputs(updates, logprobs, grammar)

    def _verify_drafts(
        self, out: SchedulerOutput, logits, entries: list[int]
    ) -> list[RequestOutput]:
        """A step that checked drafts: the sampler draws every row (a drafted entry has one per
        position), the speculator keeps the run of drafts the draws agree with. A constrained
        sequence's rows are masked as its grammar stands at each position; its matcher then
        takes the run, which ends early where it completes the grammar."""
        rows: list = []
        firsts: list[int] = []
        for i in entries:
            item = out.scheduled[i]
            firsts.append(len(rows))
            rows.extend(self.speculator.rows(item) if item.draft else [item.seq])
        matchers = self.constrained.matchers if self.constrained is not None else {}
        mask = None
        if matchers:
            from llmq.worker.spec.constrained import advance_runs, draft_masks

            spans = [
                (f, out.scheduled[i].seq, out.scheduled[i].draft)
                for f, i in zip(firsts, entries, strict=True)
            ]
            mask = draft_masks(matchers, spans, self.vocab_size)
        sampled = self.sampler(logits, rows, mask)
        runs: list[list[int] | None] = [None] * len(out.scheduled)
        logprobs: dict[int, list[TokenLogprobs | None]] = {}
        for first, i in zip(firsts, entries, strict=True):
            item = out.scheduled[i]
            draws = sampled.token_ids[first : first + 1 + len(item.draft)]
            runs[i] = self.speculator.verify(item, draws) if item.draft else draws
            logprobs[id(item.seq)] = sampled.logprobs[first : first + len(runs[i])]
        grammar = None
        if mask is not None:
            fed = [(out.scheduled[i].seq, runs[i]) for i in entries]
            grammar = advance_runs(matchers, fed)
        updates = self.scheduler.update_runs(out, runs, grammar.complete if grammar else ())
        return self._outputs(updates, logprobs, grammar)

    def _outputs(self, updates, logprobs, grammar) -> list[RequestOutput]:
        """A step's outputs from the scheduler's updates; ``logprobs``: per sequence (by id)
        those of the tokens it yields."""
        self.num_steps += 1
        outputs = []
        for u in updates:
            self.num_generated += 1 + len(u.accepted)
            if grammar is not None and u.seq in grammar.failed:
                u.seq.token_ids.pop()  # the token its grammar refused is not output
                u.seq.output_token_ids.pop()
                outputs.append(self._fail(u.seq, grammar.failed[u.seq], "grammar_error"))
                continue
            tokens = u.accepted + [u.token_id] if u.token_id is not None else []
            lp = logprobs.get(id(u.seq)) if tokens else None
            if lp is not None:
                lp = lp[: len(tokens)] if lp[0] is not None else None
            outputs.append(self._output(u.seq, tokens, u.finish_reason, lp))
            if u.finish_reason is not None:
                self._forget(u.seq)
        return outputs

    def _admit_waiting(self) -> list[RequestOutput]:
        """Move on the sequences whose adapter is loaded, hand those whose matcher is ready to
        the scheduler; fail those whose adapter or grammar failed."""
        outputs = []
        if self.loras is not None and self.loras.busy:
            ready, failed = self.loras.ready()
            for seq in ready:
                self._enter(seq)
            outputs += [self._fail(s, e, "lora_load_failed", scheduled=False) for s, e in failed]
        if self.constrained is not None and self.constrained.pending:
            ready, failed = self.constrained.ready()
            for seq in ready:
                self.scheduler.add(seq)
            outputs += [self._fail(s, e, "invalid_grammar", scheduled=False) for s, e in failed]
        return outputs

    def _wait_for_builds(self) -> None:
        """An idle step: wait a little for a matcher or an adapter being built."""
        if self.loras is not None and self.loras.loading:
            self.loras.wait(GRAMMAR_WAIT_S)
        elif self.constrained is not None and self.constrained.pending:
            self.constrained.wait(GRAMMAR_WAIT_S)

    def _fail(self, seq: Sequence, error: str, code: str, scheduled: bool = True) -> RequestOutput:
        """End ``seq`` now with ``error`` (its blocks freed); the output that says so.
        ``scheduled``: whether the scheduler holds it (not while its matcher was built)."""
        if scheduled:
            self.scheduler.abort(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
        self._forget(seq)
        log.info("request %s failed: %s", seq.request_id, error)
        out = self._output(seq, [], FinishReason.ABORT)
        out.error = EngineError(error, "invalid_request_error", code)
        return out

    def _forget(self, seq: Sequence) -> None:
        self.requests.pop(seq.request_id, None)
        if self.speculator is not None:
            self.speculator.forget(seq)
        self._discard(seq)

    def _discard(self, seq: Sequence) -> bool:
        """Drop ``seq`` from the matchers and as its adapter's user; whether it was still waiting
        for either."""
        waiting = False
        if seq.lora is not None and self.loras is not None:
            waiting = self.loras.release(seq)
        if self.constrained is not None:
            waiting = self.constrained.discard(seq.request_id) or waiting
        return waiting

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
        out = RequestOutput(
            request_id=seq.request_id,
            token_ids=tokens,
            finish_reason=reason,
            logprobs=logprobs,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )
        if seq.prompt_logprobs_pending and (tokens or reason == FinishReason.LENGTH):
            # The first output: its prompt is computed (token 0 has no logprob).
            out.prompt_logprobs = [None, *seq.prompt_logprobs]
            seq.prompt_logprobs_pending, seq.prompt_logprobs = False, []
        return out


def _speculator(engine: LLMEngine, tokenizer) -> Speculator | None:
    """The speculation the config asks for. A draft model is loaded here, its pool beside the
    engine's."""
    spec = engine.config.speculative
    if spec is None:
        return None
    proposer = None
    if spec.method == "draft":
        from llmq.worker.spec.draft_model import load_draft_proposer

        proposer = load_draft_proposer(
            spec, engine.model, tokenizer, engine.config, engine.num_blocks, engine.max_model_len
        )
    return spec.speculator(engine.max_model_len, proposer)


def _constrained_sequences(
    tokenizer, vocab_size: int, eos_token_ids, config: EngineConfig
) -> ConstrainedSequences:
    from llmq.worker.constrained_sequences import ConstrainedSequences
    from llmq.worker.grammar_compiler import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, vocab_size, sorted(eos_token_ids))
    return ConstrainedSequences(compiler, config.max_batch_size)
