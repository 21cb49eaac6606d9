"""The paths bench/engine.py times side by side (llmq's engine, HF ``generate`` one at a time
and batched, transformers' continuous batching, one decode step of the engine's runner and of
the HF DynamicCache forward), and the helpers the CPU benchmarks share (``bench/cpu_kernels.py``
imports them as ``bench_engine``)."""

from __future__ import annotations

import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ---- helpers ---------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class Clock:
    """Wall and CPU seconds (this process, all threads) of one timed phase, and the machine's
    load average around it."""

    def __init__(self):
        self.wall = self.cpu = 0.0
        self.load: list[float] = []

    def __enter__(self):
        self.load.append(os.getloadavg()[0])
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._w
        self.cpu += time.process_time() - self._c
        self.load.append(os.getloadavg()[0])

    def figures(self, tokens: int) -> dict:
        return {
            "output_tokens": tokens,
            "seconds": self.wall,
            "cpu_seconds": self.cpu,
            "tok_s": tokens / self.wall,
            "tok_per_cpu_s": tokens / self.cpu,
            "load_avg": [round(x, 2) for x in self.load],
        }


def ensure_model(path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    from llmq.tools.model_factory import make_model

    log(f"building the smollm2-135m-shaped model in {path}")
    return make_model(path, arch="llama", size="smollm2-135m")


def load(path: Path, dtype: str):
    from llmq.worker.loading.model_loader import load_causal_lm

    return load_causal_lm(str(path), dtype, "cpu")


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids from 3 up: the special tokens (eos, pad, ...) sit at the bottom of make_model's vocabulary.
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---- the paths -------------------------------------------------------------------------------
def median_steps_in_turn(engines: dict, requests: dict, steps: int) -> dict[str, float]:
    """Median decode step (ms) of each engine, the engines stepped in turn, one step apart: on
    a machine that others share, as near side by side as two paths get. ``requests[kind]``:
    that engine's (prompt, LoRA adapter or None) pairs, prefilled before the timed steps."""
    from llmq.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for kind, engine in engines.items():
        for i, (prompt, lora) in enumerate(requests[kind]):
            engine.add_request(f"t{i}", prompt, params, lora=lora)
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.requests.values()):
            engine.step()
    times: dict[str, list[float]] = {kind: [] for kind in engines}
    for _ in range(steps):
        for kind, engine in engines.items():
            t = time.perf_counter()
            engine.step()
            times[kind].append(time.perf_counter() - t)
    return {kind: statistics.median(ts) * 1000 for kind, ts in times.items()}


def run_engine(model, prompts, args) -> dict:
    """All requests at once through LLMEngine; records every step to find the steady state."""
    from llmq.common.sampling_params import SamplingParams
    from llmq.worker.llm_engine import EngineConfig, LLMEngine

    cfg = EngineConfig(max_batch_size=args.max_batch_size, max_batch_tokens=args.max_batch_tokens)
    engine = LLMEngine(model, cfg)
    # Warm up (allocator, thread pool, first-call paths) on a few short requests.
    warm = [p[:48] for p in prompts[: min(8, len(prompts))]]
    engine.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))

    # (wall s, cpu s, sequences, new tokens, context sum) of every step
    steps: list[tuple[float, float, int, int, int]] = []
    schedule = engine.scheduler.schedule
    last = {}

    def recording_schedule():
        out = schedule()
        last["out"] = out
        return out

    engine.scheduler.schedule = recording_schedule
    params = SamplingParams(temperature=0, max_tokens=args.output_tokens, ignore_eos=True)
    generated = 0
    clock = Clock()
    with clock:
        for i, p in enumerate(prompts):
            engine.add_request(f"bench-{i}", p, params)
        while engine.has_unfinished():
            w, c = time.perf_counter(), time.process_time()
            outs = engine.step()
            w, c = time.perf_counter() - w, time.process_time() - c
            generated += sum(len(o.token_ids) for o in outs)
            out = last.get("out")
            if out:
                ctx = sum(x.start + x.num_new_tokens for x in out.scheduled)
                steps.append((w, c, len(out.scheduled), out.num_tokens, ctx))
    engine.scheduler.schedule = schedule
    res = clock.figures(generated)
    res["steps"] = len(steps)
    res["preemptions"] = engine.scheduler.num_preemptions
    res["step_records"] = steps
    del engine
    gc.collect()
    return res


def combine_engine_runs(runs: list[dict], full_batch: int) -> dict:
    """The engine's figures over its runs: totals, and the steady state (pure decode steps, one
    token per sequence, at the full batch)."""
    tokens = sum(r["output_tokens"] for r in runs)
    wall = sum(r["seconds"] for r in runs)
    cpu = sum(r["cpu_seconds"] for r in runs)
    res = {
        "runs": [{k: v for k, v in r.items() if k != "step_records"} for r in runs],
        "output_tokens": tokens,
        "seconds": wall,
        "cpu_seconds": cpu,
        "tok_s": tokens / wall,
        "tok_per_cpu_s": tokens / cpu,
        "steps": sum(r["steps"] for r in runs),
        "preemptions": sum(r["preemptions"] for r in runs),
    }
    steady = [
        s for r in runs for s in r["step_records"] if s[2] == full_batch and s[3] == full_batch
    ]
    if steady:
        res["steady_steps"] = len(steady)
        res["steady_batch"] = full_batch
        res["steady_tok_s"] = full_batch * len(steady) / sum(s[0] for s in steady)
        res["steady_tok_per_cpu_s"] = full_batch * len(steady) / sum(s[1] for s in steady)
        res["steady_mean_context"] = sum(s[4] for s in steady) / (full_batch * len(steady))
    return res


def hf_generate(model, batch: list[list[int]], new_tokens: int, pad_id: int):
    import torch

    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # EOS ignored, as in the engine's requests
            pad_token_id=pad_id,
        )
    return out[:, width:]


def run_single(model, prompts, args, pad_id) -> dict:
    """One request at a time, timed on a few requests spread over the prompt lengths."""
    hf_generate(model, [prompts[0][:32]], 4, pad_id)  # warm-up
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    k = max(1, min(args.single, len(prompts)))
    picks = [order[int((j + 0.5) * len(order) / k)] for j in range(k)]
    clock = Clock()
    tokens = 0
    for i in picks:
        with clock:
            tokens += hf_generate(model, [prompts[i]], args.output_tokens, pad_id).numel()
    res = clock.figures(tokens)
    res.update(
        timed_requests=k,
        timed_prompt_lengths=[len(prompts[i]) for i in picks],
        seconds_extrapolated=clock.wall / k * len(prompts),
        extrapolated=True,
    )
    return res


def run_static(model, prompts, args, pad_id) -> dict:
    hf_generate(model, [p[:32] for p in prompts[:4]], 4, pad_id)  # warm-up
    clock = Clock()
    with clock:
        out = hf_generate(model, prompts, args.output_tokens, pad_id)
    res = clock.figures(out.numel())
    res["padded_to"] = max(map(len, prompts))
    return res


def run_hf_cb(model, prompts, args) -> dict:
    """transformers' continuous batching: a manager made with its defaults (and the workload's
    hints), warmed up and started, then timed from the first request added to the last result
    received."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(
        max_new_tokens=args.output_tokens,
        do_sample=False,
        eos_token_id=-1,  # never stops early: EOS ignored, as in the engine's requests
        pad_token_id=model.generation_config.pad_token_id,
    )
    hints = WorkloadHints(
        max_prompt_length=max(map(len, prompts)),
        max_generated_length=args.output_tokens,
        num_requests=len(prompts),
    )
    manager = model.init_continuous_batching(
        generation_config=gen,
        continuous_batching_config=ContinuousBatchingConfig(),
        workload_hints=hints,
    )
    manager.warmup()
    manager.start()
    attn = model.config._attn_implementation
    clock = Clock()
    try:
        # One more warm-up through the running loop.
        manager.add_requests(inputs=[p[:32] for p in prompts[:4]], max_new_tokens=4)
        _collect(manager, 4)
        with clock:
            manager.add_requests(inputs=prompts, max_new_tokens=args.output_tokens)
            results = _collect(manager, len(prompts))
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    res = clock.figures(sum(len(r.generated_tokens) for r in results))
    cfg = manager.continuous_batching_config
    res.update(
        attn_implementation=attn,
        max_batch_tokens=getattr(manager.batch_processor, "max_batch_tokens", None)
        or cfg.max_batch_tokens,
        max_requests_per_batch=cfg.max_requests_per_batch,
    )
    return res


def _collect(manager, n: int) -> list:
    done = []
    while len(done) < n:
        r = manager.get_result(timeout=5)
        if r is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped")
            continue
        if r.is_finished():
            if r.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed: {r.error}")
            done.append(r)
    return done


class HFDecode:
    """The model's forward with its own DynamicCache: ``batch`` sequences of ``context`` tokens,
    one token each per step (the cache is cropped back after each step, so every step sees the
    same context and pays the usual ``torch.cat`` of the cache), then the greedy pick."""

    def __init__(self, model, batch: int, context: int):
        import torch
        from transformers import DynamicCache

        from llmq.worker.runner.model_runner import model_dims

        self.model = model
        layers, kv_heads, head_dim = model_dims(model.config)
        self.cache = DynamicCache(config=model.config)
        g = torch.Generator().manual_seed(0)
        past = context - 1
        for layer in range(layers):
            k = torch.randn(batch, kv_heads, past, head_dim, generator=g).to(model.dtype)
            v = torch.randn(batch, kv_heads, past, head_dim, generator=g).to(model.dtype)
            self.cache.update(k, v, layer)
        vocab = model.config.get_text_config().vocab_size
        self.ids = torch.randint(3, vocab, (batch, 1), generator=g)
        self.pos = torch.full((batch, 1), past, dtype=torch.long)

    def step(self) -> None:
        import torch

        with torch.inference_mode():
            out = self.model(
                input_ids=self.ids,
                position_ids=self.pos,
                past_key_values=self.cache,
                use_cache=True,
            )
            out.logits[:, -1].argmax(dim=-1).tolist()
        self.cache.crop(-1)


class EngineDecode:
    """One decode step of the engine's runner and sampler: ``batch`` sequences whose KV (random)
    sits in a paged pool of the engine's default size, ``context`` tokens each counting the new
    one. ``use_kernels``: llmq's C++ kernels (off: torch's ops, oneDNN-packed weights)."""

    def __init__(self, model, batch: int, context: int, use_kernels: bool = True):
        import torch

        from llmq.common.sampling_params import SamplingParams
        from llmq.worker.engine.block_manager import BlockManager
        from llmq.worker.engine.kv_sizing import DEFAULT_KV_BUDGET_GB
        from llmq.worker.engine.scheduler import ScheduledSequence, SchedulerOutput
        from llmq.worker.engine.sequence import Sequence
        from llmq.worker.llm_engine import EngineConfig
        from llmq.worker.runner.attention.paged import KVPool
        from llmq.worker.runner.model_runner import ModelRunner, model_dims
        from llmq.worker.runner.sampler import Sampler

        cfg = EngineConfig()
        bs = cfg.block_size
        per_block = KVPool.bytes_per_block(*model_dims(model.config), bs, model.dtype)
        needed = batch * (-(-context // bs))
        num_blocks = max(needed + 1, int(DEFAULT_KV_BUDGET_GB * 2**30) // per_block)
        self.runner = ModelRunner(model, num_blocks, bs, use_kernels=use_kernels)
        # The block manager hands out blocks from the pool's front: random KV there.
        g = torch.Generator().manual_seed(0)
        used = self.runner.pool.kv[:, :, : needed * bs]
        used.copy_(torch.randn(used.shape, generator=g))
        bm = BlockManager(num_blocks, bs, enable_prefix_caching=False)
        vocab = model.config.get_text_config().vocab_size
        rng = random.Random(0)
        params = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
        items = []
        for i in range(batch):
            seq = Sequence(f"s{i}", [rng.randrange(3, vocab) for _ in range(context)], params)
            assert bm.allocate(seq, context)
            seq.num_computed_tokens = context - 1
            items.append(ScheduledSequence(seq, context - 1, 1))
        self.items = items
        self.out = SchedulerOutput(scheduled=items)
        self.seqs = [it.seq for it in items]
        self.sampler = Sampler()

    def use_batch(self, batch: int) -> None:
        """Step only the first ``batch`` sequences from now on."""
        from llmq.worker.engine.scheduler import SchedulerOutput

        self.out = SchedulerOutput(scheduled=self.items[:batch])
        self.seqs = [it.seq for it in self.items[:batch]]

    def step(self) -> None:
        logits, _, _ = self.runner.execute(self.out)
        self.sampler(logits, self.seqs)


def time_interleaved(paths: dict, repeats: int) -> dict[str, dict[str, float]]:
    """Median wall and CPU seconds per step of each path, alternating the paths so that they
    share the machine's changing load."""
    for p in paths.values():  # warm-up
        p.step()
        p.step()
    wall: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, p in paths.items():
            w, c = time.perf_counter(), time.process_time()
            p.step()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    return {
        name: {"wall": statistics.median(wall[name]), "cpu": statistics.median(cpu[name])}
        for name in paths
    }
