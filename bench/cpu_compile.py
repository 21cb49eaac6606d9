"""The compiled CPU decode step (LLMQ_CPU_COMPILE) against the eager one, side by side in one run.

Two runners of the engine on the same model (random KV at ``--step-context`` tokens for 64
sequences each): eager (packed oneDNN projections, eager glue) and compiled (``CompiledDecode``:
one decoder layer compiled by Inductor, its warm-up timed). Decode steps at batch 1, 32 and 64
alternate between the two (median of each), and are set against the machine's matmul ceiling:
F.linear and the packed oneDNN linear timed on the model's own projection shapes at the same row
counts, in the same run. ``fraction of ceiling``: the model's FLOPs per token times tok/s, over
the GFLOP/s of its matmuls alone at that row count. Peak RSS: the process's growth while each
runner is built and warmed.

    .venv/bin/python bench/cpu_compile.py            # bfloat16, batches 1,32,64
    .venv/bin/python bench/engine.py            # the same, as the last phase of the whole run
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import engine_paths as bench_engine  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def projection_shapes(config) -> list[tuple[int, int, int]]:
    """(out, in, count) of every matmul of a decode step's projections, lm_head included."""
    c = config.get_text_config()
    heads, kv = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // heads
    h, n = c.hidden_size, c.num_hidden_layers
    return [
        ((heads + 2 * kv) * d, h, n),
        (h, heads * d, n),
        (2 * c.intermediate_size, h, n),
        (h, c.intermediate_size, n),
        (c.vocab_size, h, 1),
    ]


def flops_per_token(config, context: int) -> float:
    c = config.get_text_config()
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    matmul = sum(2 * o * i * k for o, i, k in projection_shapes(config))
    attention = 4 * c.num_hidden_layers * c.num_attention_heads * d * context
    return matmul + attention


class MatmulCeiling:
    """GFLOP/s of the model's projections alone at a row count, F.linear, packed for oneDNN and
    in llmq's panels (where its kernels serve): one weight per layer, as in the model (a weight
    reused 30 times would be timed from the cache, not from memory as a decode step reads
    it)."""

    def __init__(self, config, dtype):
        import torch
        import torch.nn.functional as F

        from llmq.worker.runner import cpu_kernels
        from llmq.worker.runner.linear.packed_linear import Linear, can_pack, panels_fit

        shapes = projection_shapes(config)
        self.weights = [torch.randn(o, i).to(dtype) for o, i, k in shapes for _ in range(k)]
        self.dtype = dtype
        self.kinds = {"f_linear": [lambda x, w=w: F.linear(x, w) for w in self.weights]}
        if can_pack(self.weights[0]):
            self.kinds["packed"] = [Linear(w, None, "onednn") for w in self.weights]
        if cpu_kernels.load() and all(panels_fit(w) for w in self.weights):
            self.kinds["panels"] = [Linear(w, None, "panels") for w in self.weights]

    def gflops(self, rows: int, repeats: int = 5) -> dict[str, float]:
        import torch

        xs = [torch.randn(rows, w.shape[1]).to(self.dtype) for w in self.weights]
        flops = sum(2 * rows * w.numel() for w in self.weights)
        out: dict[str, float] = {}
        for name, fns in self.kinds.items():
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                for fn, x in zip(fns, xs, strict=True):
                    fn(x)
                times.append(time.perf_counter() - start)
            out[name] = flops / min(times) / 1e9
        return out


def run(args, model_dir: Path) -> dict:
    batches = [int(x) for x in args.compile_batches.split(",")]
    paths, rss, warm_s = {}, {}, 0.0
    for name in ("eager", "compiled"):
        before = rss_mb()
        model = bench_engine.load(model_dir, args.dtype)
        start = time.perf_counter()
        paths[name] = bench_engine.EngineDecode(
            model, max(batches), args.step_context, cpu_compile=name == "compiled"
        )
        if name == "compiled":
            warm_s = paths[name].runner.compiled.warm_up_s
            bench_engine.log(f"  compiled runner built in {time.perf_counter() - start:.1f} s")
        rss[name] = rss_mb() - before
    config = paths["eager"].runner.model.config
    ceilings = MatmulCeiling(config, paths["eager"].runner.dtype)
    res: dict = {"warm_up_s": warm_s, "context": args.step_context, "batches": {}}
    for b in batches:
        for p in paths.values():
            p.use_batch(b)
        secs = bench_engine.time_interleaved(paths, args.step_repeats)
        ceiling = ceilings.gflops(b)
        flops = flops_per_token(config, args.step_context)
        row = {"ceiling_gflops": ceiling}
        for name in paths:
            tok_s = b / secs[name]["wall"]
            row[name] = {
                "tok_s": tok_s,
                "tok_per_cpu_s": b / secs[name]["cpu"],
                "fraction_of_ceiling": {
                    kind: tok_s * flops / 1e9 / gflops for kind, gflops in ceiling.items()
                },
            }
        row["ratio"] = secs["eager"]["wall"] / secs["compiled"]["wall"]
        row["ratio_cpu"] = secs["eager"]["cpu"] / secs["compiled"]["cpu"]
        res["batches"][str(b)] = row
        bench_engine.log(
            f"  batch {b}: eager {row['eager']['tok_s']:.1f} tok/s, compiled "
            f"{row['compiled']['tok_s']:.1f} tok/s, x{row['ratio']:.2f}"
        )
    for name in paths:
        res[f"rss_growth_mb_{name}"] = rss[name]
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    del paths
    gc.collect()
    return res


def _percents(fractions: dict[str, float]) -> str:
    """A step's share of each matmul ceiling: F.linear / packed / panels (0: not measured)."""
    kinds = ("f_linear", "packed", "panels")
    return " / ".join(f"{100 * fractions.get(k, 0):.0f}%" for k in kinds)


def print_table(res: dict, dtype: str, threads: int) -> None:
    lines = [
        "",
        f"decode step, eager vs compiled (LLMQ_CPU_COMPILE), {dtype}, {threads} threads, context "
        f"{res['context']}, interleaved, median; compile warm-up {res['warm_up_s']:.1f} s",
        f"{'batch':<7}{'eager t/s':>11}{'compiled t/s':>14}{'ratio':>8}{'ratio cpu':>11}"
        f"{'F.linear GF/s':>15}{'packed GF/s':>13}{'panels GF/s':>13}"
        f"{'eager % of F.linear/packed/panels':>35}{'compiled %':>18}",
    ]
    for b, r in res["batches"].items():
        c = r["ceiling_gflops"]
        fe, fc = r["eager"]["fraction_of_ceiling"], r["compiled"]["fraction_of_ceiling"]
        lines.append(
            f"{b:<7}{r['eager']['tok_s']:>11.1f}{r['compiled']['tok_s']:>14.1f}{r['ratio']:>7.2f}x"
            f"{r['ratio_cpu']:>10.2f}x{c['f_linear']:>15.1f}{c.get('packed', 0):>13.1f}"
            f"{c.get('panels', 0):>13.1f}{_percents(fe):>35}{_percents(fc):>18}"
        )
    lines.append(
        f"RSS growth: eager runner {res['rss_growth_mb_eager']:.0f} MB, compiled runner "
        f"{res['rss_growth_mb_compiled']:.0f} MB (built and warmed); peak RSS of the run "
        f"{res['peak_rss_mb']:.0f} MB"
    )
    print("\n".join(lines), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(ROOT / "bench/out/models/smollm2-135m"))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--compile-batches", default="1,32,64")
    p.add_argument("--step-context", type=int, default=256)
    p.add_argument("--step-repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    import torch

    threads = args.threads or bench_engine.cores()
    torch.set_num_threads(threads)
    model_dir = bench_engine.ensure_model(Path(args.model_dir))
    res = run(args, model_dir)
    print_table(res, args.dtype, threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
