"""Single calls of llmq's integer kernels in several weight forms, alternating call by call in one
process: the fastest and the tenth-fastest of ``--calls`` calls a form, weights of random values
(``kernel_ab.py``'s forms: 8s, 8m, 4k, 4g, 6g) cycled through about 256 MB so that they come
from memory. On a shared host the fastest calls are the ones no other process interrupted, where
``kernel_ab.py``'s per-process rounds move with the load.

    .venv/bin/python bench/form_calls.py --forms 8s,8m,4k,4g --rows 1,16 --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--forms", default="8s,8m,4k,4g")
    p.add_argument("--rows", default="1,16")
    p.add_argument("--shape", default="2048x8192", help="OUTxIN")
    p.add_argument("--calls", type=int, default=150)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch
    from kernel_ab import random_groups

    from llmq.worker.runner import cpu_kernels
    from llmq.worker.runner.linear.quantized_linear import Int4Linear, Int6Linear, Int8Linear

    torch.set_num_threads(args.threads)
    assert cpu_kernels.load(), "llmq's kernels did not build"
    n, k = (int(v) for v in args.shape.split("x"))
    copies = max(2, (256 << 20) // (n * k))
    gen = torch.Generator().manual_seed(0)
    kinds = {"4": Int4Linear, "6": Int6Linear, "8": Int8Linear}
    forms = {}
    for form in args.forms.split(","):
        kind = kinds[form[0]]
        held = [random_groups(n, k, form, gen) for _ in range(copies)]
        forms[form] = [kind(h, None) if kind is Int6Linear else kind(h, None, True) for h in held]
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, k, generator=gen).bfloat16()
        times: dict[str, list[float]] = {form: [] for form in forms}
        for i in range(args.calls):
            for form, linears in forms.items():
                start = time.perf_counter()
                linears[i % copies](x)
                times[form].append(time.perf_counter() - start)
        for form, spent in times.items():
            spent.sort()
            mib = forms[form][0].nbytes() / 2**20
            print(
                f"{args.shape} {form} rows {rows}: fastest {spent[0] * 1e3:.3f} ms, tenth "
                f"{spent[len(spent) // 10] * 1e3:.3f} ms ({mib:.1f} MiB a weight)"
            )


if __name__ == "__main__":
    main()
