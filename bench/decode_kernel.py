"""llmq's C++ decode attention (``kernels/paged_decode.cpp``) against its own earlier version and
against the torch path, side by side in one run.

``--baseline REV`` (default HEAD): the kernel's sources at that git revision, built under
another op name (``paged_decode_attention_base``) into the kernels' cache and loaded beside
the tree's, so both run in one process on the same pool. Rounds alternate between the
variants; each figure is the median of its rounds. Three tables:

- plain layers (no window, softcap or sinks), the tree's kernel over the baseline's: what a
  model without those features pays for them (1.00x: nothing);
- windowed, softcapped and sinked layers: the kernel against the gathered torch path
  (``attention.featured_attention``), as served before the kernel took them;
- a window against none at the same context: what skipping the keys out of it saves.

Shapes: SmolLM2-135M's heads (9 query, 3 KV, dim 64), blocks of 16. Peak RSS and the CPU at
the end.

    .venv/bin/python bench/decode_kernel.py
    .venv/bin/python bench/decode_kernel.py --dtype float32 --batches 1,16 --rounds 5
    .venv/bin/python bench/decode_kernel.py --threads 1 --clock cpu   # on a busy machine
"""

from __future__ import annotations

import argparse
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KERNEL_FILES = ("paged_decode.cpp", "vec.h", "ops.h")
HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
ROUND_US = 50_000  # a round of one function: at most about this long, at least one call
# The clock: wall time, or (--clock cpu) this process's CPU time, which leaves out the time other
# processes hold its core (with one thread, a steadier figure on a busy machine).
clock = time.perf_counter


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "?")


def load_baseline(rev: str) -> str:
    """Build (once) and load the kernel of ``rev`` as ``torch.ops.llmq.paged_decode_attention_base``;
    returns the commit it was built from."""
    import torch

    from llmq.worker.runner import cpu_kernels

    kernels = "llmq/worker/runner/kernels"
    commit = subprocess.check_output(["git", "rev-parse", rev], cwd=ROOT, text=True).strip()
    library = cpu_kernels.default_cache_dir() / f"paged_decode_base_{commit[:12]}.so"
    if not library.exists():
        compiler = cpu_kernels._compiler()
        library.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            for name in KERNEL_FILES:
                text = subprocess.check_output(
                    ["git", "show", f"{commit}:{kernels}/{name}"], cwd=ROOT, text=True
                )
                renamed = re.sub(r"\bpaged_decode_attention\b", "paged_decode_attention_base", text)
                (Path(tmp) / name).write_text(renamed)
            obj = Path(tmp) / "base.o"
            cpu_kernels._run_all(
                [cpu_kernels._compile_command(compiler, Path(tmp) / KERNEL_FILES[0], obj)]
            )
            cpu_kernels._run_all([cpu_kernels._link_command(compiler, [obj], library)])
    torch.ops.load_library(str(library))
    return commit


class Case:
    """One layer's decodes: ``batch`` sequences of ``context`` tokens in a random pool."""

    def __init__(self, batch: int, context: int, dtype, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        per_seq = -(-context // BLOCK)
        blocks = batch * per_seq + 8
        self.kv = torch.randn(2 * KV_HEADS, blocks * BLOCK, DIM, generator=g).to(dtype)
        order = torch.randperm(blocks, generator=g)[: batch * per_seq]
        self.tables = order.view(batch, per_seq).to(torch.int32)
        self.lens = torch.full((batch,), context, dtype=torch.int32)
        packed = torch.randn(batch, HEADS + 2 * KV_HEADS, DIM, generator=g).to(dtype)
        self.query = packed[:, :HEADS]  # strided, as the forward hands it over
        self.out = torch.empty(batch, HEADS, DIM, dtype=dtype)
        self.sinks = torch.randn(HEADS, generator=g).to(dtype)
        self.batch, self.context, self.blocks = batch, context, blocks

    def kernel(self, op: str = "paged_decode_attention", **features):
        import torch

        fn = getattr(torch.ops.llmq, op)
        args = (self.out, self.query, self.kv, self.tables, self.lens, BLOCK, DIM**-0.5)
        return lambda: fn(*args, **features)

    def torch_path(self, window: int, softcap: float | None, sinks: bool):
        """``featured_attention``'s gathered decode path over the same pool and tables."""
        import torch

        from llmq.worker.runner.attention.paged import (
            DecodeChunk,
            KVPool,
            StepMetadata,
            featured_decode_chunk,
        )

        pool = KVPool(1, KV_HEADS, DIM, self.blocks, BLOCK, self.kv.dtype, torch.device("cpu"))
        pool.kv[0].copy_(self.kv)
        n, nb = self.batch, self.tables.shape[1]
        k_pos = torch.arange(nb * BLOCK)[None, :]
        hidden = (k_pos >= self.context) | (k_pos < self.context - window if window else False)
        mask = torch.zeros(n, nb * BLOCK, dtype=self.kv.dtype).masked_fill_(hidden, -torch.inf)
        mask = mask.repeat(KV_HEADS, 1).unsqueeze(1)
        masks = {window: mask} if window else None
        chunk = DecodeChunk(0, n, nb, self.tables.view(-1).long(), mask, masks)
        q_all = self.query.transpose(0, 1).unflatten(0, (KV_HEADS, HEADS // KV_HEADS))
        out = torch.empty(n, HEADS, DIM, dtype=self.kv.dtype)
        step = StepMetadata(pool, torch.zeros(0, dtype=torch.long), n, [chunk], [])
        sink = self.sinks if sinks else None
        return lambda: featured_decode_chunk(
            chunk, q_all, out, step.pool, 0, DIM**-0.5, window or None, softcap, sink
        )


def interleaved_rounds(fns: dict, rounds: int, calls: int) -> dict[str, list[float]]:
    """us a call of each of ``fns``, one figure a round, rounds alternating between them; up to
    ``calls`` calls a round, fewer for a function slower than ROUND_US / calls."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    counts = {}
    for name, fn in fns.items():
        fn()
        start = clock()
        fn()
        took = max((clock() - start) * 1e6, 1.0)
        counts[name] = max(1, min(calls, int(ROUND_US / took)))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = clock()
            for _ in range(counts[name]):
                fn()
            samples[name].append((clock() - start) / counts[name] * 1e6)
    return samples


def interleaved_us(fns: dict, rounds: int, calls: int) -> dict[str, float]:
    """Median us a call of each of ``fns`` (``interleaved_rounds``)."""
    samples = interleaved_rounds(fns, rounds, calls)
    return {name: statistics.median(s) for name, s in samples.items()}


def plain_table(args, dtype) -> None:
    print(f"\nplain layers: the tree's kernel against {args.baseline}'s (us a layer; median "
          "and fastest round, the latter the steadier on a busy machine)")  # fmt: skip
    print(f"{'batch':>6}{'context':>9}{'baseline':>10}{'tree':>9}{'tree/base':>11}"
          f"{'fastest: base':>15}{'tree':>9}{'tree/base':>11}")  # fmt: skip
    for context in args.contexts:
        for batch in args.batches:
            case = Case(batch, context, dtype)
            fns = {"base": case.kernel("paged_decode_attention_base"), "tree": case.kernel()}
            samples = interleaved_rounds(fns, args.rounds, args.calls)
            us = {name: statistics.median(s) for name, s in samples.items()}
            fast = {name: min(s) for name, s in samples.items()}
            print(f"{batch:>6}{context:>9}{us['base']:>10.1f}{us['tree']:>9.1f}"
                  f"{us['tree'] / us['base']:>10.2f}x{fast['base']:>15.1f}{fast['tree']:>9.1f}"
                  f"{fast['tree'] / fast['base']:>10.2f}x")  # fmt: skip


FEATURES = [  # (label, window, softcap, sinks)
    ("window 128", 128, None, False),
    ("softcap 50", 0, 50.0, False),
    ("window 128 + softcap", 128, 50.0, False),
    ("sinks", 0, None, True),
    ("window 128 + sinks", 128, None, True),
]


def features_table(args, dtype) -> None:
    context = max(args.contexts)
    print(f"\nfeatured layers at context {context}: kernel against the gathered torch path (us)")
    print(f"{'layer':<22}{'batch':>6}{'torch':>10}{'kernel':>9}{'torch/kernel':>14}")
    for label, window, softcap, sinks in FEATURES:
        for batch in args.batches:
            case = Case(batch, context, dtype)
            features = dict(window=window, softcap=softcap or 0.0)
            if sinks:
                features["sinks"] = case.sinks
            fns = {
                "torch": case.torch_path(window, softcap, sinks),
                "kernel": case.kernel(**features),
            }
            us = interleaved_us(fns, args.rounds, args.calls)
            print(f"{label:<22}{batch:>6}{us['torch']:>10.1f}{us['kernel']:>9.1f}"
                  f"{us['torch'] / us['kernel']:>13.2f}x")  # fmt: skip


def window_table(args, dtype) -> None:
    context = max(args.contexts)
    print(f"\nthe kernel at context {context}: a window of 128 against none (us)")
    print(f"{'batch':>6}{'no window':>11}{'window':>9}{'none/window':>13}")
    for batch in args.batches:
        case = Case(batch, context, dtype)
        fns = {"none": case.kernel(), "window": case.kernel(window=128)}
        us = interleaved_us(fns, args.rounds, args.calls)
        print(f"{batch:>6}{us['none']:>11.1f}{us['window']:>9.1f}"
              f"{us['none'] / us['window']:>12.2f}x")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="HEAD", help="git revision of the kernel to compare")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--contexts", default="256,1024")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="0: every core this process may use")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="cpu: --threads 1")
    args = p.parse_args(argv)
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    args.batches = [int(b) for b in args.batches.split(",")]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    import os

    import torch

    from llmq.worker.runner import cpu_kernels

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    if not cpu_kernels.load():
        print("the kernels did not build (is g++ installed?)")
        return 1
    commit = load_baseline(args.baseline)
    dtype = getattr(torch, args.dtype)
    print(f"{cpu_model()}, {threads} threads, {args.dtype}, {args.clock} clock; baseline "
          f"{commit[:12]}; medians of {args.rounds} alternating rounds")  # fmt: skip
    plain_table(args, dtype)
    features_table(args, dtype)
    window_table(args, dtype)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS of the run {peak:.0f} MB; load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
