"""llmq's C++ CPU kernels (LLMQ_CPU_KERNELS) against torch's ops, side by side in one run.

Two runners of the engine on the same model in one process (random KV at ``--step-context``
tokens for 64 sequences each): one with the kernels (weights in llmq's panels, the decode
attention kernel, every layer of a step in one C++ call), one with torch's ops (oneDNN-packed
weights, the gathered KV and two batched matmuls, the Python layer loop). Decode steps at each
batch alternate between the two (median of each); then the attention alone at the same shapes,
the kernel against the gather and ``bmm``. ``--projections``: instead, each projection of the
model's shape on llmq's panels against oneDNN's packed matmul at 1-256 rows, the weights cycled
through 256 MB of copies so that they come from memory, as in a step. Peak RSS of the run at
the end. ``--quantized``: the Llama-3.2-1B shape's projections in int4 and int8 on llmq's VNNI
kernels (``kernels/int_matmul.cpp``) against torch's weight-only kernels, the same way.

    .venv/bin/python bench/cpu_kernels.py                 # bfloat16, batches 1,4,16,32,64
    .venv/bin/python bench/cpu_kernels.py --threads 1
    .venv/bin/python bench/cpu_kernels.py --projections
    .venv/bin/python bench/cpu_kernels.py --quantized --rows 1,4,16,128
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import engine_paths as bench_engine  # noqa: E402


def attention_us(batch: int, context: int, repeats: int = 50) -> dict[str, float]:
    """One layer's decode attention (SmolLM2-135M's heads: 9 query, 3 KV, dim 64), in us."""
    import torch

    from llmq.worker.runner.attention.paged import attend_gathered

    heads, kv_heads, dim, bs, blocks = 9, 3, 64, 16, 4000
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2 * kv_heads, blocks * bs, dim, generator=g).to(torch.bfloat16)
    per_seq = -(-context // bs)
    tables = torch.randperm(blocks, generator=g)[: batch * per_seq].view(batch, per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(heads, batch, dim, generator=g).to(torch.bfloat16).transpose(0, 1)
    out = torch.empty(batch, heads, dim, dtype=torch.bfloat16)
    flat = kv.view(2 * kv_heads * blocks, bs * dim)
    ids = (torch.arange(2 * kv_heads)[:, None] * blocks + tables.view(1, -1)).view(-1)
    gathered = torch.empty(ids.shape[0], bs * dim, dtype=torch.bfloat16)
    grouped = q.transpose(0, 1).unflatten(0, (kv_heads, heads // kv_heads)).permute(0, 2, 1, 3)
    grouped = grouped.reshape(kv_heads * batch, heads // kv_heads, dim).contiguous()
    no_mask = torch.zeros(1, 1, 1, dtype=torch.bfloat16)
    tables32 = tables.to(torch.int32)

    def torch_ops():
        torch.index_select(flat, 0, ids, out=gathered)
        view = gathered.view(2, kv_heads * batch, per_seq * bs, dim)
        attend_gathered(grouped, view, no_mask, dim**-0.5)

    def kernel():
        torch.ops.llmq.paged_decode_attention(out, q, kv, tables32, lens, bs, dim**-0.5)

    times = {}
    for name, fn in (("torch", torch_ops), ("kernel", kernel)):
        for _ in range(5):
            fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        times[name] = (time.perf_counter() - start) / repeats * 1e6
    return times


# SmolLM2-135M's projections (qkv, o, gate_up, down) and its head, (out, in) features.
PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def us_per_call(linears: list, x) -> float:
    """Microseconds a call of each of ``linears`` on ``x`` took, over three passes through all
    of them (after two warm-up calls): their weights come from memory, not a cache."""
    for lin in linears[:2]:
        lin(x)
    start = time.perf_counter()
    for _ in range(3):
        for lin in linears:
            lin(x)
    return (time.perf_counter() - start) / (3 * len(linears)) * 1e6


def projections(rows_list: list[int], bytes_cycled: int = 256 << 20) -> None:
    """Each projection on llmq's panels, with each of its sums (vdpbf16ps, float32 FMAs: the
    kernel takes the FMAs from 8 rows where they are switched on; AMX tiles where available:
    "-" where not), against oneDNN's packed matmul, weights from memory: cycled through copies
    of ``bytes_cycled`` in all, far more than a cache holds. GB/s and GFLOP/s: the fastest
    sums'."""
    import torch

    from llmq.worker.runner.linear.packed_linear import Linear, amx_available, panel_sums

    sums = ["dot", "fma", *(["amx"] if amx_available() else [])]
    print(f"{'projection':<12}{'rows':>6}{'oneDNN us':>11}{'dot us':>9}{'fma us':>9}"
          f"{'amx us':>9}{'oneDNN/best':>13}{'GB/s':>7}{'GFLOP/s':>9}")  # fmt: skip
    for out_f, in_f in PROJECTIONS:
        n = max(2, bytes_cycled // (2 * out_f * in_f))
        weights = [torch.randn(out_f, in_f).bfloat16() for _ in range(n)]
        kinds = {k: [Linear(w, None, k) for w in weights] for k in ("onednn", "panels")}
        for rows in rows_list:
            x = torch.randn(rows, in_f).bfloat16()
            us = {"oneDNN": us_per_call(kinds["onednn"], x)}
            for name in sums:  # side by side, in one process
                with panel_sums(name):
                    us[name] = us_per_call(kinds["panels"], x)
            best = min(us[name] for name in sums)
            gbs = out_f * in_f * 2 / best / 1e3
            gflops = 2 * rows * out_f * in_f / best / 1e3
            amx = f"{us['amx']:>9.1f}" if "amx" in us else f"{'-':>9}"
            print(f"{out_f}x{in_f:<7}{rows:>6}{us['oneDNN']:>11.1f}{us['dot']:>9.1f}"
                  f"{us['fma']:>9.1f}{amx}{us['oneDNN'] / best:>12.2f}x{gbs:>7.1f}"
                  f"{gflops:>9.0f}")  # fmt: skip


QUANTIZED_PROJECTIONS = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))  # 1B's


def quantized_projections(rows_list: list[int], bytes_cycled: int = 256 << 20) -> None:
    """Each 1B projection quantized (int4, int8) on llmq's kernel and on torch's, weights cycled
    through copies of ``bytes_cycled`` (int8 bytes) in all. GB/s: llmq's weight bytes read."""
    import torch

    from llmq.worker.runner.linear.quantized_linear import quantized_linear

    print(f"{'projection':<12}{'bits':>5}{'rows':>6}{'torch us':>10}{'llmq us':>9}"
          f"{'torch/llmq':>12}{'GB/s':>7}")  # fmt: skip
    for out_f, in_f in QUANTIZED_PROJECTIONS:
        n = max(2, bytes_cycled // (out_f * in_f))
        weights = [torch.randn(out_f, in_f) * 0.02 for _ in range(n)]
        for bits in (4, 8):
            kinds = {
                kind: [quantized_linear(w, None, bits, kind == "llmq") for w in weights]
                for kind in ("torch", "llmq")
            }
            for rows in rows_list:
                x = torch.randn(rows, in_f).bfloat16()
                us = {}
                for kind, linears in kinds.items():
                    us[kind] = us_per_call(linears, x)
                gbs = kinds["llmq"][0].nbytes() / us["llmq"] / 1e3
                print(f"{out_f}x{in_f:<7}{bits:>5}{rows:>6}{us['torch']:>10.1f}"
                      f"{us['llmq']:>9.1f}{us['torch'] / us['llmq']:>11.2f}x{gbs:>7.1f}")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", default=str(ROOT / "bench/out/models/smollm2-135m"))
    p.add_argument("--batches", default="1,4,16,32,64")
    p.add_argument("--step-context", type=int, default=256)
    p.add_argument("--step-repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--projections", action="store_true", help="the projections alone")
    p.add_argument("--quantized", action="store_true", help="int4/int8 projections alone")
    p.add_argument("--rows", default="1,4,8,16,32,64,128,256", help="with --projections")
    args = p.parse_args(argv)
    import torch

    from llmq.worker.runner import cpu_kernels

    threads = args.threads or bench_engine.cores()
    torch.set_num_threads(threads)
    if not cpu_kernels.load():
        print("the kernels did not build (is g++ installed?)")
        return 1
    if args.quantized:
        if not torch.ops.llmq.int_matmul_available():
            print("this CPU has no AVX512-VNNI: torch's int4/int8 kernels serve")
            return 1
        print(f"{threads} threads, bfloat16 activations, weights cycled through copies")
        quantized_projections([int(r) for r in args.rows.split(",")])
        return 0
    if args.projections:
        if not torch.ops.llmq.panel_matmul_available():
            print("this CPU has no AVX512-BF16: llmq's panels do not serve")
            return 1
        print(f"bfloat16, {threads} threads, each projection's weights cycled through copies")
        projections([int(r) for r in args.rows.split(",")])
        print(
            f"peak RSS of the run {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB"
        )
        return 0
    model_dir = bench_engine.ensure_model(Path(args.model_dir))
    batches = [int(b) for b in args.batches.split(",")]
    paths = {}
    for name in ("torch", "kernels"):
        path = bench_engine.EngineDecode(
            bench_engine.load(model_dir, "bfloat16"),
            max(batches),
            args.step_context,
            use_kernels=name == "kernels",
        )
        paths[name] = path
    print(f"bfloat16, {threads} threads, context {args.step_context}, interleaved medians")
    print(f"{'batch':<7}{'torch tok/s':>12}{'kernels tok/s':>15}{'ratio':>8}"
          f"{'attention torch us':>20}{'kernel us':>11}{'ratio':>8}")  # fmt: skip
    for b in batches:
        for path in paths.values():
            path.use_batch(b)
        secs = bench_engine.time_interleaved(paths, args.step_repeats)
        t, k = secs["torch"]["wall"], secs["kernels"]["wall"]
        att = attention_us(b, args.step_context)
        print(f"{b:<7}{b / t:>12.1f}{b / k:>15.1f}{t / k:>7.2f}x"
              f"{att['torch']:>20.1f}{att['kernel']:>11.1f}{att['torch'] / att['kernel']:>7.2f}x")  # fmt: skip
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of the run {peak:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
