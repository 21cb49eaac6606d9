"""Text-only requests on the tiny Qwen2.5-VL against its text model alone (a Qwen 2 folder of
the same weights), side by side in one run: time to first token and a lone stream's decode
tokens/s through the API, and each worker's forward plan.

    .venv/bin/python bench/qwen_vl_text.py --rounds 2 --requests 4
    .venv/bin/python bench/qwen_vl_text.py --in-process    # the engines alone, CPU time


The Qwen2.5-VL folder is `llmq make-model --arch qwen2_5_vl`; its language model and head are
saved as a Qwen2ForCausalLM (same weights, tokenizer and rotary base: every text row's three
M-RoPE positions are equal, so both models compute the same tokens). One redis-server, one
`llmq worker` of each (float32, as the tests start them) and one `llmq api`; `llmq bench`
(chat, concurrency 1, greedy) runs against each model in turn, rounds alternating, so that
both see the same load on the host. Prints each round and the medians, and beside the
wall-clock figures the CPU time each worker spent per request (from /proc), which other load on
the host moves much less than it moves the times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from compare_procs import CLK, tree  # noqa: E402  (bench/, beside this file)

from llmq.common.transport.redis_server import RedisServer  # noqa: E402
from tests.harness import heartbeat, kill_all, start_api, start_worker, wait_worker  # noqa: E402

LLMQ = str(Path(sys.executable).with_name("llmq"))


def text_model(vlm: Path, out: Path) -> Path:
    """The Qwen2.5-VL folder's language model and head as a Qwen 2 folder of their own."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from transformers import Qwen2_5_VLForConditionalGeneration as VL

    vl = VL.from_pretrained(vlm, dtype=torch.float32)
    text = vl.config.text_config.to_dict()
    for key in ("model_type", "architectures", "mrope_section", "transformers_version"):
        text.pop(key, None)
    config = Qwen2Config(**text)
    config.rope_parameters = {"rope_type": "default", "rope_theta": text["rope_parameters"]["rope_theta"]}  # fmt: skip
    config.llmq_random_weights = getattr(vl.config, "llmq_random_weights", False)
    lm = Qwen2ForCausalLM(config).float()
    lm.model.load_state_dict(vl.model.language_model.state_dict())
    lm.lm_head.load_state_dict(vl.lm_head.state_dict())
    lm.generation_config = vl.generation_config
    lm.save_pretrained(out)
    AutoTokenizer.from_pretrained(vlm).save_pretrained(out)
    return out


def bench(base: str, model: str, tokenizer: Path, args, out: Path) -> dict:
    cmd = [LLMQ, "bench", "--base-url", base, "--model", model, "--tokenizer", str(tokenizer),
           "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
           "--output-tokens", str(args.output_tokens), "--warmup", "2", "--json", str(out),
           "--no-progress", "--quiet"]  # fmt: skip
    subprocess.run(cmd, check=True)
    s = json.loads(out.read_text())["summary"]
    assert s["errors"] == 0 and s["short_outputs"] == 0, s
    return {"ttft_ms": s["ttft_s"]["p50"] * 1000, "decode_tok_s": 1 / s["tpot_s"]["p50"]}


def measured(base: str, model: str, tokenizer: Path, args, out: Path, worker) -> dict:
    """One `llmq bench` run and the CPU its worker spent per request (warm-ups included)."""
    before = sum(tree(worker.proc.pid).values())
    row = bench(base, model, tokenizer, args, out)
    ticks = sum(tree(worker.proc.pid).values()) - before
    row["worker_cpu_ms"] = ticks * 1000 / CLK / (args.requests + 2)
    return row


def run(args, root: Path) -> None:
    from llmq.tools.model_factory import make_model

    vlm = make_model(root / "qwen2_5_vl", arch="qwen2_5_vl")
    folders = {"vlm": vlm, "text": text_model(vlm, root / "text")}
    logs = root / "logs"
    logs.mkdir()
    with RedisServer() as server:
        workers = {
            name: start_worker(server.url, path, f"w-{name}", logs, wait=False)
            for name, path in folders.items()
        }
        api, base = start_api(server.url, folders["text"], logs)
        try:
            for name, proc in workers.items():
                wait_worker(server.url, f"w-{name}", proc, timeout=600)
            served = {name: heartbeat(server.url, f"w-{name}")["model"] for name in folders}
            for name in folders:
                plan = heartbeat(server.url, f"w-{name}")["forward_plan"]
                print(f"{name}: {served[name]}, forward plan: {plan}")
            rows: dict[str, list[dict]] = {name: [] for name in folders}
            for r in range(args.rounds):
                for name in folders if r % 2 == 0 else reversed(folders):
                    row = measured(base, served[name], folders[name], args, root / "b.json",
                                   workers[name])  # fmt: skip
                    rows[name].append(row)
                    print(f"round {r} {name:>4}: {line(row)}", flush=True)
            for name, got in rows.items():
                median = {k: statistics.median(x[k] for x in got) for k in got[0]}
                print(f"median {name:>4}: {line(median)}")
        finally:
            kill_all([*workers.values(), api])


def line(row: dict) -> str:
    return (f"TTFT {row['ttft_ms']:.1f} ms, decode {row['decode_tok_s']:.1f} tok/s, "
            f"worker CPU {row['worker_cpu_ms']:.0f} ms a request")  # fmt: skip


def in_process(args, root: Path) -> None:
    """Each model's engine in this process (the VLM's with its vision runtime attached, as its
    worker runs it), one torch thread: one greedy request at a time, the CPU time per prompt
    step and per decoded token, rounds alternating; medians."""
    import time

    import torch

    from llmq.common.sampling_params import SamplingParams
    from llmq.tools.model_factory import make_model
    from llmq.worker.llm_engine import EngineConfig, LLMEngine
    from llmq.worker.loading.model_loader import load_causal_lm
    from llmq.worker.vision.qwen2_5_vl import load_qwen2_5_vl
    from llmq.worker.vision.runtime import VisionRuntime

    torch.set_num_threads(1)
    vlm = make_model(root / "qwen2_5_vl", arch="qwen2_5_vl")
    lm, encoder = load_qwen2_5_vl(str(vlm), torch.float32, "cpu")
    engines = {
        "vlm": LLMEngine(lm, EngineConfig(num_blocks=64)),
        "text": LLMEngine(load_causal_lm(str(text_model(vlm, root / "text")), "float32", "cpu"),
                          EngineConfig(num_blocks=64)),
    }  # fmt: skip
    engines["vlm"].runner.vision = VisionRuntime(encoder, lambda digest: None)
    sent = iter(range(1 << 30))  # each prompt its own first token: no prefix-cache hit
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in engines if r % 2 == 0 else reversed(engines):
            engine = engines[name]
            for n in (1, args.output_tokens):  # the prompt step alone, then with decodes
                params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                start = time.process_time()
                for _ in range(args.requests):
                    first = next(sent)
                    prompt = [first % 1000 + 10] + [
                        (7 * i) % 200 + 10 for i in range(1, args.prompt_tokens)
                    ]
                    engine.generate([prompt], params)
                rows[name].append((n, (time.process_time() - start) / args.requests))
    for name, got in rows.items():
        first = statistics.median(t for n, t in got if n == 1)
        whole = statistics.median(t for n, t in got if n > 1)
        per_token = (whole - first) / (args.output_tokens - 1)
        print(f"{name:>4}: prompt step {first * 1000:.2f} ms CPU, a decoded token "
              f"{per_token * 1000:.3f} ms CPU ({1 / per_token:.0f} tok/s of CPU)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--in-process", action="store_true", help="the engines alone, CPU time")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="qwen-vl-text-") as tmp:
        (in_process if args.in_process else run)(args, Path(tmp))


if __name__ == "__main__":
    main()
