"""Mixture of experts: llmq's MoE layer against transformers' own module, in process; and the
Qwen3-MoE moe-1b shape (8 experts, 2 active; 1.02B parameters, 0.29B active a token) served by llmq
against llama.cpp's server on the same weights, one stream and 16.

    .venv/bin/python bench/moe.py layer                    # one MoE layer, batch 1 and 16
    .venv/bin/python bench/moe.py layer --dtype bfloat16
    .venv/bin/python bench/moe.py step --rounds 3 --repeats 2  # the whole model's decode step
    .venv/bin/python bench/moe.py serve                    # llmq vs llama.cpp (bench/compare.py)
    .venv/bin/python bench/moe.py serve --servers llmq --rounds 1 --llmq-env LLMQ_DTYPE=float32

``layer``: one layer of the moe-1b shape with random weights, its block as transformers builds
it (router, then its default experts path) against llmq's (``llmq/worker/runner/forward/moe.py``: the
step's token-expert pairs grouped by expert, weights packed where the CPU allows), alternating
rounds; prints the median time of each and their ratio, and the peak RSS.

``serve``: builds the model folder once (``llmq make-model --arch qwen3_moe --size moe-1b``),
then runs ``bench/compare.py`` with two loads of its own (s1: one stream of 128 prompt / 64
output tokens; s16: 16 streams of 128 / 64); every other option is compare.py's (``--rounds``,
``--llmq-env``, ``--servers``: llmq,llamacpp by default). compare.py serves llmq in bfloat16
unless ``--llmq-env LLMQ_DTYPE=...`` says otherwise; llama.cpp serves a bf16 GGUF.
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL_DIR = ROOT / "bench/out/models/qwen3-moe-1b"
SERVE_LOADS = {
    "s1": {"concurrency": 1, "prompt": 128, "output": 64, "requests": 4},
    "s16": {"concurrency": 16, "prompt": 128, "output": 64, "requests": 32},
}


def _block(dtype):
    """One MoE block of the moe-1b shape with random weights, as transformers builds it."""
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from llmq.tools.model_factory import SHAPES

    config = Qwen3MoeConfig(**SHAPES["moe-1b"])
    config._experts_implementation = "grouped_mm"  # from_pretrained's default here
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.02)
    return block.to(dtype).eval(), config


def _time(fn, x, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        out.append(time.perf_counter() - start)
    return out


def layer(args) -> int:
    import torch

    from llmq.worker.runner import cpu_kernels
    from llmq.worker.runner.forward.moe import from_block, moe_layout

    dtype = getattr(torch, args.dtype)
    block, config = _block(dtype)
    kernels = cpu_kernels.load()
    mine = copy.deepcopy(block)
    layout = moe_layout(mine, pack=True, kernels=kernels)
    moe = from_block(mine, layout)
    print(
        f"one MoE layer: hidden {config.hidden_size}, {config.num_experts} experts of "
        f"{config.moe_intermediate_size}, {config.num_experts_per_tok} active; {args.dtype}, "
        f"{torch.get_num_threads()} torch threads; llmq's experts {layout}"
    )
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for batch in args.batches:
            x = torch.randn(batch, config.hidden_size, generator=gen).to(dtype)
            theirs = lambda x: block(x.unsqueeze(0))  # noqa: E731
            times: dict[str, list[float]] = {"transformers": [], "llmq": []}
            for _ in range(args.rounds):  # alternating: the machine is shared
                times["transformers"] += _time(theirs, x, args.repeats)
                times["llmq"] += _time(moe, x, args.repeats)
            t_med = statistics.median(times["transformers"]) * 1e3
            l_med = statistics.median(times["llmq"]) * 1e3
            print(
                f"batch {batch:3d}: transformers {t_med:7.3f} ms, llmq {l_med:7.3f} ms, "
                f"llmq {t_med / l_med:.2f}x as fast"
            )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak:.2f} GiB")
    return 0


def _engine(model_dir: Path, fast: bool, batch: int):
    """An engine on the moe-1b model in float32 with ``batch`` sequences past their prefill."""
    from llmq.common.sampling_params import SamplingParams
    from llmq.worker.llm_engine import EngineConfig, LLMEngine
    from llmq.worker.loading.model_loader import load_causal_lm

    model = load_causal_lm(str(model_dir), "float32", "cpu")
    engine = LLMEngine(
        model, EngineConfig(num_blocks=64 * batch, fast_forward=fast), eos_token_ids=set()
    )
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [(7 * i + j) % 1000 + 3 for j in range(64)], params)
    started: set[str] = set()
    while len(started) < batch:
        started |= {out.request_id for out in engine.step() if out.token_ids}
    return engine


def step(args) -> int:
    """One decode step of the whole moe-1b model (float32): llmq's forward with its MoE layers
    against transformers' forward with its own MoE blocks (llmq's paged attention in both)."""
    import torch

    model_dir = Path(args.model_dir)
    print(f"decode step, moe-1b float32, {torch.get_num_threads()} torch threads", flush=True)
    for batch in args.batches:
        engines = {
            "transformers": _engine(model_dir, False, batch),
            "llmq": _engine(model_dir, True, batch),
        }
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                times[name] += _time(lambda _, e=engine: e.step(), None, args.repeats)
        t_med, l_med = (statistics.median(times[n]) * 1e3 for n in ("transformers", "llmq"))
        print(
            f"batch {batch:3d}: transformers' forward {t_med:7.1f} ms, llmq's {l_med:7.1f} ms, "
            f"llmq {t_med / l_med:.2f}x as fast",
            flush=True,
        )
        del engines
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak:.2f} GiB")
    return 0


def serve(rest: list[str]) -> int:
    sys.path.insert(0, str(ROOT / "bench"))
    import compare

    model = Path(_option(rest, "--model-dir") or MODEL_DIR)
    if not (model / "config.json").exists():
        from llmq.tools.model_factory import make_model

        print(f"building the moe-1b Qwen3-MoE model in {model}", flush=True)
        make_model(model, arch="qwen3_moe", size="moe-1b")
    compare.LOADS.clear()
    compare.LOADS.update(SERVE_LOADS)
    argv = ["--model-dir", str(model)] if _option(rest, "--model-dir") is None else []
    if _option(rest, "--servers") is None:
        argv += ["--servers", "llmq,llamacpp"]
    if _option(rest, "--loads") is None:
        argv += ["--loads", ",".join(SERVE_LOADS)]
    out = ROOT / "bench/out"
    if _option(rest, "--json") is None:
        argv += ["--json", str(out / "moe.json"), "--png", str(out / "moe.png")]
    return compare.main(argv + rest)


def _option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        return serve(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["layer", "step", "serve"])
    p.add_argument("--model-dir", default=str(MODEL_DIR))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    return step(args) if args.mode == "step" else layer(args)


if __name__ == "__main__":
    sys.exit(main())
