"""Side-by-side throughput of the llmq engine against transformers on the same model and cores.

Builds (once) a random-weight model of the SmolLM2-135M shape with ``make_model``, loads it in
bfloat16 (or --dtype float32) and, in one run, generates the same requests (random prompts,
fixed output length, EOS ignored) through:

* llmq's LLMEngine (continuous batching over the paged KV cache), run first and again last so
  that a machine whose load drifts during the run does not favour either side;
* HF ``generate`` one request at a time (timed on a few requests, extrapolated);
* HF ``generate`` on the whole batch, left-padded;
* transformers' own continuous batching (a warmed-up ``init_continuous_batching`` manager);
* the raw decode limit: the model's forward with its own DynamicCache at the engine's batch size
  and mean decode context, timing decode steps only (no prefill, no scheduling), interleaved
  with the engine's runner at the same shape.

It then times one decode step (one token per sequence) of the engine's runner against the HF
DynamicCache forward at batch 32 and 64, context 256, interleaved.

Every figure is taken twice: by wall clock (the headline) and by the process's CPU time (user +
system, all threads). On a machine that other jobs share, wall-clock ratios of phases that ran
minutes apart carry the load's changes; CPU-time ratios mostly do not (the load average during
each phase is recorded too). Absolute figures depend on the machine; compare ratios. Figures go
to stdout and to a JSON file.

    .venv/bin/python bench/engine.py            # the full run (several minutes on 2 cores)
    .venv/bin/python bench/engine.py --quick    # a smaller run, for a smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
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

TARGETS = {  # engine / path, from the issue
    "hf_continuous_batching": 2.0,
    "hf_static_batch": 1.3,
    "hf_one_at_a_time": 15.0,
}
TARGET_STEADY_VS_RAW = 0.85
TARGET_DECODE_STEP = 2.5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Throughput of the llmq engine against transformers, side by side in one run.",
    )
    p.add_argument(
        "--model-dir",
        default=str(ROOT / "bench/out/models/smollm2-135m"),
        help="model folder; built with make_model (llama, smollm2-135m) if missing",
    )
    p.add_argument("--requests", type=int, default=64, help="number of requests (64)")
    p.add_argument("--min-prompt", type=int, default=64, help="shortest prompt, tokens (64)")
    p.add_argument("--max-prompt", type=int, default=512, help="longest prompt, tokens (512)")
    p.add_argument("--output-tokens", type=int, default=128, help="tokens per request (128)")
    p.add_argument("--max-batch-size", type=int, default=64, help="engine max_batch_size (64)")
    p.add_argument(
        "--max-batch-tokens", type=int, default=512, help="engine max_batch_tokens (512)"
    )
    p.add_argument(
        "--engine-runs",
        type=int,
        choices=(1, 2),
        default=2,
        help="2: the engine runs first and last, figures from both (default); 1: first only",
    )
    p.add_argument(
        "--single",
        type=int,
        default=3,
        help="requests timed for one-at-a-time generate, then extrapolated (3)",
    )
    p.add_argument("--step-batches", default="32,64", help="batches of the decode-step comparison")
    p.add_argument("--step-context", type=int, default=256, help="its context (256)")
    p.add_argument(
        "--compile-batches",
        default="1,32,64",
        help="batches of the eager vs compiled (LLMQ_CPU_COMPILE) decode-step comparison",
    )
    p.add_argument(
        "--step-repeats", type=int, default=10, help="decode steps timed per path, interleaved (10)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: the cores)")
    p.add_argument(
        "--skip",
        default="",
        help="comma-separated paths to leave out: single,static,hf_cb,raw,steps,compile",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="bfloat16 (default; slow where the CPU emulates it: see LLMQ_DTYPE) or float32",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small run: 16 requests, prompts 32..128, 32 output tokens, one engine run, "
        "decode steps at batch 32 only",
    )
    p.add_argument("--out", default=str(ROOT / "bench/out/engine.json"), help="JSON output file")
    args = p.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 16)
        args.min_prompt, args.max_prompt = 32, 128
        args.output_tokens = min(args.output_tokens, 32)
        args.single = min(args.single, 2)
        args.step_repeats = min(args.step_repeats, 4)
        args.step_batches = "32"
        args.compile_batches = "1,32"
        args.engine_runs = 1
        args.max_batch_size = min(args.max_batch_size, args.requests)
    return args


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
    from llmq.common.model_factory import make_model

    log(f"building the smollm2-135m-shaped model in {path}")
    return make_model(path, arch="llama", size="smollm2-135m")


def load(path: Path, dtype: str):
    from llmq.common.model_loader import load_causal_lm

    return load_causal_lm(str(path), dtype, "cpu")


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids from 3 up: the special tokens (eos, pad, ...) sit at the bottom of make_model's vocabulary.
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---- the paths -------------------------------------------------------------------------------
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
    one. ``cpu_compile``: decode steps through the compiled forward (compiled here);
    ``use_kernels``: llmq's C++ kernels (off: torch's ops, oneDNN-packed weights)."""

    def __init__(
        self, model, batch: int, context: int, cpu_compile: bool = False, use_kernels: bool = True
    ):
        import torch

        from llmq.common.sampling_params import SamplingParams
        from llmq.worker.engine.block_manager import BlockManager
        from llmq.worker.engine.kv_sizing import DEFAULT_KV_BUDGET_GB
        from llmq.worker.engine.scheduler import ScheduledSequence, SchedulerOutput
        from llmq.worker.engine.sequence import Sequence
        from llmq.worker.llm_engine import EngineConfig
        from llmq.worker.runner.attention import KVPool
        from llmq.worker.runner.model_runner import ModelRunner, model_dims
        from llmq.worker.runner.sampler import Sampler

        cfg = EngineConfig()
        bs = cfg.block_size
        per_block = KVPool.bytes_per_block(*model_dims(model.config), bs, model.dtype)
        needed = batch * (-(-context // bs))
        num_blocks = max(needed + 1, int(DEFAULT_KV_BUDGET_GB * 2**30) // per_block)
        self.runner = ModelRunner(
            model, num_blocks, bs, cpu_compile=cpu_compile, use_kernels=use_kernels
        )
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


# ---- main ------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    logging.getLogger("transformers").setLevel(logging.ERROR)
    transformers.logging.set_verbosity_error()
    threads = args.threads or cores()
    torch.set_num_threads(threads)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    model_dir = ensure_model(Path(args.model_dir))
    hf = load(model_dir, args.dtype)
    vocab = hf.config.get_text_config().vocab_size
    pad_id = hf.generation_config.pad_token_id or 0
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt, vocab, args.seed)
    mean_prompt = sum(map(len, prompts)) / len(prompts)
    full_batch = min(args.max_batch_size, len(prompts))
    log(
        f"model {model_dir.name} {args.dtype}, {threads} torch threads, {len(prompts)} requests, "
        f"prompts {args.min_prompt}..{args.max_prompt} (mean {mean_prompt:.0f}), "
        f"{args.output_tokens} output tokens, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, load average {os.getloadavg()[0]:.1f}"
    )
    report: dict = {
        "config": {
            "model": str(model_dir),
            "dtype": args.dtype,
            "threads": threads,
            "cores": cores(),
            "requests": len(prompts),
            "prompt_tokens": [args.min_prompt, args.max_prompt],
            "mean_prompt": mean_prompt,
            "output_tokens": args.output_tokens,
            "max_batch_size": args.max_batch_size,
            "max_batch_tokens": args.max_batch_tokens,
            "quick": args.quick,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "throughput": {},
    }
    thr = report["throughput"]

    # The engine takes its model over (packed bfloat16 weights replace the modules' own), so
    # every engine path gets a freshly loaded copy.
    def eng_model():
        return load(model_dir, args.dtype)

    engine_runs = []
    log("llmq engine ...")
    engine_runs.append(run_engine(eng_model(), prompts, args))
    log(f"  {engine_runs[-1]['tok_s']:.1f} tok/s")

    if "single" not in skip:
        log(f"HF generate one at a time ({args.single} requests timed, extrapolated) ...")
        thr["hf_one_at_a_time"] = run_single(hf, prompts, args, pad_id)
        log(f"  {thr['hf_one_at_a_time']['tok_s']:.1f} tok/s")
    if "static" not in skip:
        log("HF generate, whole batch left-padded ...")
        thr["hf_static_batch"] = run_static(hf, prompts, args, pad_id)
        log(f"  {thr['hf_static_batch']['tok_s']:.1f} tok/s")
    if "hf_cb" not in skip:
        log("transformers continuous batching ...")
        cb_model = load(model_dir, args.dtype)
        try:
            thr["hf_continuous_batching"] = run_hf_cb(cb_model, prompts, args)
            log(f"  {thr['hf_continuous_batching']['tok_s']:.1f} tok/s")
        except Exception as e:  # report it, keep the other figures
            log(f"  failed: {e!r}")
            thr["hf_continuous_batching"] = {"error": repr(e)}
        del cb_model
        gc.collect()

    if args.engine_runs == 2:
        log("llmq engine, again ...")
        engine_runs.append(run_engine(eng_model(), prompts, args))
        log(f"  {engine_runs[-1]['tok_s']:.1f} tok/s")
    eng = thr["llmq_engine"] = combine_engine_runs(engine_runs, full_batch)

    if "raw" not in skip:
        batch = full_batch
        ctx = round(eng.get("steady_mean_context", mean_prompt + args.output_tokens / 2))
        log(f"raw decode limit (HF forward + DynamicCache, batch {batch}, context {ctx}) ...")
        paths = {"raw": HFDecode(hf, batch, ctx), "engine": EngineDecode(eng_model(), batch, ctx)}
        secs = time_interleaved(paths, args.step_repeats)
        thr["raw_decode_limit"] = {
            "batch": batch,
            "context": ctx,
            "tok_s": batch / secs["raw"]["wall"],
            "tok_per_cpu_s": batch / secs["raw"]["cpu"],
            "engine_runner_same_shape_tok_s": batch / secs["engine"]["wall"],
            "engine_runner_same_shape_tok_per_cpu_s": batch / secs["engine"]["cpu"],
            "note": "decode steps only: no prefill, no scheduling",
        }
        del paths
        gc.collect()
        log(f"  {thr['raw_decode_limit']['tok_s']:.1f} tok/s")

    steps: dict = {}
    if "steps" not in skip:
        for b in [int(x) for x in args.step_batches.split(",") if x]:
            log(f"decode step, batch {b}, context {args.step_context} ...")
            paths = {
                "hf_dynamic_cache": HFDecode(hf, b, args.step_context),
                "llmq_runner": EngineDecode(eng_model(), b, args.step_context),
            }
            secs = time_interleaved(paths, args.step_repeats)
            eng_s, hf_s = secs["llmq_runner"], secs["hf_dynamic_cache"]
            steps[str(b)] = {
                "context": args.step_context,
                "llmq_runner_tok_s": b / eng_s["wall"],
                "hf_dynamic_cache_tok_s": b / hf_s["wall"],
                "ratio": hf_s["wall"] / eng_s["wall"],
                "llmq_runner_tok_per_cpu_s": b / eng_s["cpu"],
                "hf_dynamic_cache_tok_per_cpu_s": b / hf_s["cpu"],
                "ratio_cpu": hf_s["cpu"] / eng_s["cpu"],
            }
            del paths
            gc.collect()
    report["decode_step"] = steps
    if "compile" not in skip:
        import cpu_compile as compile_bench

        log(f"decode step, eager vs compiled, batches {args.compile_batches} ...")
        report["cpu_compile"] = compile_bench.run(args, model_dir)
    report["load_avg_end"] = os.getloadavg()[0]

    report["ratios"] = print_table(report, args, threads, len(prompts), mean_prompt)
    if "cpu_compile" in report:
        compile_bench.print_table(report["cpu_compile"], args.dtype, threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {out}")
    return 0


def print_table(report: dict, args, threads: int, n: int, mean_prompt: float) -> dict:
    thr, steps = report["throughput"], report["decode_step"]
    eng = thr["llmq_engine"]
    ratios: dict = {}
    w = 46
    lines = [
        "",
        f"{n} requests, prompts {args.min_prompt}..{args.max_prompt} random tokens (mean "
        f"{mean_prompt:.0f}), {args.output_tokens} output tokens each (EOS ignored), {args.dtype}, "
        f"{threads} threads",
        f"{'path':<{w}}{'tok/s':>9}{'engine/path':>13}{'tok/cpu-s':>11}{'engine/path':>13}"
        f"{'target':>9}{'load':>11}",
        f"{'':<{w}}{'(wall clock)':>22}{'(CPU time)':>24}",
    ]
    names = {
        "llmq_engine": f"llmq engine (max_batch_size {args.max_batch_size})",
        "hf_one_at_a_time": "HF generate, one at a time (extrapolated*)",
        "hf_static_batch": "HF generate, whole batch, left-padded",
        "hf_continuous_batching": "transformers continuous batching",
        "raw_decode_limit": "raw decode limit (HF forward + DynamicCache)",
    }

    def load_of(r):
        la = r.get("load_avg")
        return f"{min(la):.1f}-{max(la):.1f}" if la else ""

    for key, label in names.items():
        r = thr.get(key)
        if not r:
            continue
        if "tok_s" not in r:
            lines.append(f"{label:<{w}}{'failed':>9}")
            continue
        rw, rc = eng["tok_s"] / r["tok_s"], eng["tok_per_cpu_s"] / r["tok_per_cpu_s"]
        ratios[key] = {"wall": rw, "cpu": rc}
        target = TARGETS.get(key)
        tgt = f">= {target:g}x" if target else ""
        loads = ", ".join(load_of(x) for x in eng["runs"]) if key == "llmq_engine" else load_of(r)
        lines.append(
            f"{label:<{w}}{r['tok_s']:>9.1f}{rw:>12.2f}x{r['tok_per_cpu_s']:>11.1f}{rc:>12.2f}x"
            f"{tgt:>9}{loads:>11}"
        )
    raw = thr.get("raw_decode_limit")
    if "steady_tok_s" in eng:
        label = f"llmq steady-state decode (batch {eng['steady_batch']})"
        line = f"{label:<{w}}{eng['steady_tok_s']:>9.1f}"
        if raw:
            rw = eng["steady_tok_s"] / raw["tok_s"]
            rc = eng["steady_tok_per_cpu_s"] / raw["tok_per_cpu_s"]
            ratios["steady_vs_raw"] = {"wall": rw, "cpu": rc}
            line += (
                f"{rw:>12.2f}x{eng['steady_tok_per_cpu_s']:>11.1f}{rc:>12.2f}x"
                f"{'>= ' + str(TARGET_STEADY_VS_RAW) + 'x':>9}  of the raw limit"
            )
        lines.append(line)
    if "hf_one_at_a_time" in thr:
        s = thr["hf_one_at_a_time"]
        lines.append(
            f"* one at a time: {s['timed_requests']} requests timed (prompt lengths "
            f"{s['timed_prompt_lengths']}), {s['seconds']:.1f} s, extrapolated to {n} requests "
            f"({s['seconds_extrapolated']:.0f} s)"
        )
    if raw:
        lines.append(
            f"raw decode limit: batch {raw['batch']}, context {raw['context']} (the engine's "
            f"steady-state batch and mean context); the engine's runner at that shape, "
            f"interleaved with it: {raw['engine_runner_same_shape_tok_s']:.1f} tok/s, "
            f"{raw['engine_runner_same_shape_tok_per_cpu_s']:.1f} tok/cpu-s"
        )
    runs = eng["runs"]
    run_secs = ", ".join(f"{r['seconds']:.1f}" for r in runs)
    run_rates = ", ".join(f"{r['tok_s']:.1f}" for r in runs)
    lines.append(
        f"engine: {len(runs)} run(s) of {run_secs} s (tok/s {run_rates}), {eng['steps']} steps, "
        f"{eng['preemptions']} preemptions; load average = runnable tasks on "
        f"{report['config']['cores']} cores"
    )
    if steps:
        lines += [
            "",
            f"decode step (one token per sequence), context {args.step_context}, interleaved, "
            "median of each",
            f"{'batch':<8}{'llmq runner':>13}{'HF DynamicCache':>17}{'ratio':>9}"
            f"{'ratio by CPU time':>19}{'target':>9}",
        ]
        for b, r in steps.items():
            lines.append(
                f"{b:<8}{r['llmq_runner_tok_s']:>9.1f} t/s{r['hf_dynamic_cache_tok_s']:>13.1f} t/s"
                f"{r['ratio']:>8.2f}x{r['ratio_cpu']:>18.2f}x"
                f"{'>= ' + str(TARGET_DECODE_STEP) + 'x':>9}"
            )
            ratios[f"decode_step_{b}"] = {"wall": r["ratio"], "cpu": r["ratio_cpu"]}
    print("\n".join(lines), flush=True)
    return ratios


if __name__ == "__main__":
    sys.exit(main())
