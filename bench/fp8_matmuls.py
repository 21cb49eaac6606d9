"""One projection in bfloat16, in fp8 with a scale per row (``Fp8Linear``) and in fp8 with a
scale per 128 x 128 block (``Fp8BlockLinear``), side by side on a CUDA GPU (needs one; the
block-scaled form a Hopper one).

    python bench/fp8_matmuls.py [--rows 1,16,64,256,1024]

For the projections of a Llama-3.1-8B layer (qkv 4096 -> 6144, o 4096 -> 4096, gate/up
4096 -> 28672, down 14336 -> 4096), each form's time per call (activation quantization
included) for each row count, from 20 calls replayed in a CUDA graph, the best of 5 replays,
and the ratio to bfloat16. Each form is also checked against the float64 product of its
quantized operands' dequantized values.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.write_fp8 import block_tensors  # noqa: E402
from llmq.worker.loading.quant_checkpoint.fp8_tensor import fp8_block_matmuls  # noqa: E402
from llmq.worker.runner.linear.dynamic_quantized import Fp8Linear  # noqa: E402
from llmq.worker.runner.linear.fp8_blocks import Fp8BlockLinear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CALLS = 20


def per_call_us(fn, x: torch.Tensor) -> float:
    """Microseconds a call, from ``CALLS`` calls captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(x)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / CALLS)
    return best


def forms(weight: torch.Tensor) -> dict:
    out = {"bf16": lambda x: F.linear(x, weight), "fp8 row": Fp8Linear.quantize(weight, None)}
    if fp8_block_matmuls(weight.device):
        blocks = block_tensors(weight)
        out["fp8 blocks"] = Fp8BlockLinear(blocks["weight"], blocks["weight_scale_inv"], None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,256,1024")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    print(torch.cuda.get_device_name(), "us per call (ratio to bf16)")
    print("| projection | form | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("| --- " * (2 + len(rows)) + "|")
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        weight = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        table = forms(weight)
        times = {form: [] for form in table}
        for m in rows:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            exact = x.double() @ weight.double().T
            for form, fn in table.items():
                times[form].append(per_call_us(fn, x))
                error = (fn(x).double() - exact).norm() / exact.norm()
                assert error < 0.06, (name, form, m, float(error))
        for form, values in times.items():
            cells = " | ".join(
                f"{t:.1f} ({times['bf16'][i] / t:.2f}x)" for i, t in enumerate(values)
            )
            print(f"| {name} | {form} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
