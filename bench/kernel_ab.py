"""llmq's integer kernels (and bfloat16 panels) as a git revision builds them against the working
tree's, side by side.

Each side's ``kernels/*.cpp`` and headers are compiled into a library of their own (the cache key
is the sources), and each round runs one process per side in turn, timing the 1B shape's
projections in int4 and int8 (``quantized_linear`` on llmq's kernels; ``--bits`` also 6, 16:
bfloat16 panels, q6k: GGUF's Q6_K blocks, 4g and 6g: GGUF's Q4_1 and Q5_1 groups, 4k: int4's
k-quant blocks, 8s and 8m: int8 symmetric and with a minimum per group; these of random values,
not quantized: a side's round takes seconds, not minutes of quantizing), weights cycled through 256 MB so that they come from
memory. A side's figure is its fastest round: on a shared 2-core VM a
build's own rounds of one shape differed by up to 1.4x, so compare the minimums of several
alternating rounds, not one run each. Prints, per projection, bits and rows, both sides' us,
the base's time over the tree's (above 1: the tree is faster) and the tree's GOPS, then the
children's peak RSS.

    .venv/bin/python bench/kernel_ab.py --base HEAD~1 --rows 1,16,128 --bits 4 --rounds 4

``--march x86-64-v3`` builds both sides for AVX2 (no AVX-512) on a newer CPU: the AVX2 kernels
measured on the same machine as its AVX-512 ones. ``--terms 1,2`` sets the int8 terms each side
rounds activations into (``LLMQ_INT_ACTIVATIONS``; base's, then the tree's): with ``--base``
at the tree's sources, one build timed both ways.

    .venv/bin/python bench/kernel_ab.py --base HEAD --terms 1,2 --bits 4,6,8,q6k --rounds 3
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "llmq/worker/runner/kernels"


def checkout_kernels(rev: str, into: Path) -> Path:
    """The kernel sources of ``rev`` written into ``into``."""
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{rev}:{KERNELS}"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    for name in names:
        blob = subprocess.run(
            ["git", "show", f"{rev}:{KERNELS}/{name}"], cwd=ROOT, check=True, capture_output=True
        ).stdout
        (into / name).write_bytes(blob)
    return into


def random_q6k(n: int, k: int, gen):
    """Q6_K blocks of random codes, steps and sub-block scales ([N, K] weights)."""
    import torch

    from llmq.worker.runner.linear.quantized_weights import Q6KBlocks

    return Q6KBlocks(
        torch.randint(0, 64, (n, k), generator=gen, dtype=torch.uint8),
        (torch.rand(n, k // 256, generator=gen) * 1e-3).half(),
        torch.randint(-128, 128, (n, k // 16), generator=gen, dtype=torch.int8),
    )


def random_groups(n: int, k: int, bits: str, gen):
    """Random values, steps and bases ([N, K] weights) as Q4_1 (4g) or Q5_1 (6g) groups, int8
    with a minimum (8m), symmetric (8s) or int4's k-quant blocks (4k)."""
    import torch

    from llmq.worker.runner.linear import quantized_weights as qw

    if bits == "8s":
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        return qw.Int8Weight(q, (torch.rand(n, k // 32, generator=gen) * 1e-3).half())
    if bits == "4k":
        groups, supers = k // 32, -(-k // 256)
        return qw.Int4Blocks(
            torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
            (torch.rand(n, supers, generator=gen) * 1e-3).half(),
            (torch.randn(n, supers, generator=gen) * 1e-2).half(),
            torch.randint(0, 256, (n, groups), generator=gen, dtype=torch.uint8),
            torch.randint(-127, 128, (n, groups), generator=gen, dtype=torch.int8),
        )
    kind = {"4g": qw.Int4Groups, "6g": qw.Int6Groups, "8m": qw.Int8Groups}[bits]
    return kind(
        torch.randint(0, kind.LEVELS + 1, (n, k), generator=gen, dtype=torch.uint8),
        (torch.rand(n, k // 32, generator=gen) * 1e-3).half(),
        (torch.randn(n, k // 32, generator=gen) * 1e-2).half(),
    )


def time_side(
    sources: Path, rows_list: list[int], bits_list: list[str], shapes, march: str, terms: int = 0
) -> dict:
    """In a child: us per call of each (shape, bits, rows) on the kernels built from ``sources``
    for ``march`` (a -march value)."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import torch
    from cpu_kernels import QUANTIZED_PROJECTIONS, us_per_call

    from llmq.worker.runner import cpu_kernels

    cpu_kernels.SOURCES = sorted(sources.glob("*.cpp"))
    cpu_kernels.HEADERS = sorted(sources.glob("*.h"))
    cpu_kernels.FLAGS[cpu_kernels.FLAGS.index("-march=native")] = f"-march={march}"
    if not cpu_kernels.load():
        raise SystemExit(f"the kernels in {sources} did not build")
    if terms:
        cpu_kernels.set_activation_terms(terms)
    from llmq.worker.runner.linear.packed_linear import Linear
    from llmq.worker.runner.linear.quantized_linear import (
        Int4Linear,
        Int6Linear,
        Int8Linear,
        Q6KLinear,
        quantized_linear,
    )

    def linear(weight, bits: str):  # 16: bfloat16 on the panel kernel (panel_matmul.cpp)
        if bits == "16":
            return Linear(weight.bfloat16(), None, "panels")
        if bits == "q6k":  # Q6_K's blocks (GGUF), random codes: the time is the bytes' and sums'
            return Q6KLinear(random_q6k(*weight.shape, gen), None)
        if bits in ("4g", "4k", "6g", "8s", "8m"):
            held = random_groups(*weight.shape, bits, gen)
            kind = {"4": Int4Linear, "6": Int6Linear, "8": Int8Linear}[bits[0]]
            return kind(held, None) if kind is Int6Linear else kind(held, None, True)
        return quantized_linear(weight, None, int(bits), True)

    gen = torch.Generator().manual_seed(0)
    figures = {}
    for out_f, in_f in shapes or QUANTIZED_PROJECTIONS:
        copies = max(2, (256 << 20) // (out_f * in_f))
        weights = [torch.randn(out_f, in_f, generator=gen) * 0.02 for _ in range(copies)]
        for bits in bits_list:
            linears = [linear(w, bits) for w in weights]
            for rows in rows_list:
                x = torch.randn(rows, in_f, generator=gen).bfloat16()
                figures[f"{out_f}x{in_f} {bits} {rows}"] = us_per_call(linears, x)
    return figures


def report(best: dict[str, dict[str, float]]) -> str:
    lines = [f"{'projection':<12}{'bits':>5}{'rows':>6}{'base us':>10}{'tree us':>10}"
             f"{'base/tree':>11}{'tree GOPS':>11}"]  # fmt: skip
    for key, base_us in best["base"].items():
        shape, bits, rows = key.split()
        out_f, in_f = (int(v) for v in shape.split("x"))
        tree_us = best["tree"][key]
        gops = 2 * int(rows) * out_f * in_f / tree_us / 1e3
        lines.append(f"{shape:<12}{bits:>5}{rows:>6}{base_us:>10.1f}{tree_us:>10.1f}"
                     f"{base_us / tree_us:>10.2f}x{gops:>11.0f}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="the git revision to compare against")
    p.add_argument("--rows", default="1,16,128")
    p.add_argument("--bits", default="4,8", help="4, 6, 8, q6k, 4g, 4k, 6g, 8s, 8m, 16 (see above)")
    p.add_argument("--march", default="native", help="the ISA both sides are built for")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--shapes", default="", help="OUTxIN,... (default: the 1B's four)")
    p.add_argument("--terms", default="", help="BASE,TREE activation terms (1 or 2) a side sets")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-terms", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    bits = args.bits.split(",")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    if args.child:
        figures = time_side(Path(args.child), rows, bits, shapes, args.march, args.child_terms)
        print(json.dumps(figures))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"base": checkout_kernels(args.base, Path(tmp)), "tree": ROOT / KERNELS}
        best: dict[str, dict[str, float]] = {"base": {}, "tree": {}}
        terms = dict(zip(sides, args.terms.split(","), strict=True)) if args.terms else {}
        for round_ in range(args.rounds):
            for side, sources in sides.items():
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(sources), "--rows", args.rows,
                     "--bits", args.bits, "--shapes", args.shapes, "--march", args.march,
                     "--child-terms", terms.get(side, "0")],
                    check=True, capture_output=True, text=True,
                ).stdout  # fmt: skip
                for key, us in json.loads(out.strip().splitlines()[-1]).items():
                    best[side][key] = min(us, best[side].get(key, float("inf")))
            print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    print(
        f"base {args.base} against the working tree (-march={args.march}"
        f"{f', terms {args.terms}' if args.terms else ''}), fastest of "
        f"{args.rounds} alternating rounds"
    )
    print(report(best))
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    print(f"peak RSS of a side's process {peak:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
