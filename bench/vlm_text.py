"""Text-only requests on a vision-language model against its text model alone, side by side in
one run: time to first token and a lone stream's decode tokens/s through the API.

    .venv/bin/python bench/vlm_text.py                    # the tiny LLaVA of `llmq make-model`
    .venv/bin/python bench/vlm_text.py --shape smollm2    # SmolLM2-135M as the LLaVA's text model
    .venv/bin/python bench/vlm_text.py --family qwen      # the tiny Qwen2.5-VL (M-RoPE)
    .venv/bin/python bench/vlm_text.py --family qwen --in-process   # its engines alone, CPU time

The vision-language folder is a LLaVA-1.5 (``--family llava``): ``tiny`` is `llmq make-model
--arch llava`; ``smollm2`` is SmolLM2-135M-Instruct (float32, from tests/real_models.py) with a
small CLIP tower and projector around it. The text model is the LLaVA's own language model and
head saved alone as a Llama folder (the same weights and tokenizer). With ``--family qwen`` it
is `llmq make-model --arch qwen2_5_vl`, its language model and head saved as a
Qwen2ForCausalLM (same weights, tokenizer and rotary base: every text row's three M-RoPE
positions are equal, so both models compute the same tokens). One redis-server, one `llmq
worker` of each (LLMQ_TORCH_THREADS=1) and one `llmq api`; `llmq bench` (chat, concurrency 1,
greedy) runs against each model in turn, rounds alternating, so that both see the same load on
the host. Prints each round and the medians, and each worker's forward plan. Beside the
wall-clock figures, the CPU time the worker and the API processes spent per request (from
/proc), which other load on the host moves much less than it moves the times.

``--in-process`` (Qwen2.5-VL) runs each model's engine in this process instead, one torch
thread: the CPU time of a prompt step and of a decoded token.
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
    """The LLaVA folder's language model and head as a causal LM folder of their own."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    llava = AutoModelForImageTextToText.from_pretrained(vlm, dtype=torch.float32)
    config = llava.config.text_config
    config.llmq_random_weights = getattr(llava.config, "llmq_random_weights", False)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return saved_text(lm, llava, vlm, out)


def qwen_text_model(vlm: Path, out: Path) -> Path:
    """The Qwen2.5-VL folder's language model and head as a Qwen 2 folder of their own."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration as VL
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vl = VL.from_pretrained(vlm, dtype=torch.float32)
    text = vl.config.text_config.to_dict()
    for key in ("model_type", "architectures", "mrope_section", "transformers_version"):
        text.pop(key, None)
    config = Qwen2Config(**text)
    config.rope_parameters = {"rope_type": "default", "rope_theta": text["rope_parameters"]["rope_theta"]}  # fmt: skip
    config.llmq_random_weights = getattr(vl.config, "llmq_random_weights", False)
    return saved_text(Qwen2ForCausalLM(config).float(), vl, vlm, out)


def saved_text(lm, vl, vlm: Path, out: Path) -> Path:
    """``lm`` given the vision-language model ``vl``'s language model, head and generation
    settings, saved in ``out`` with the tokenizer of its folder ``vlm``."""
    from transformers import AutoTokenizer

    lm.model.load_state_dict(vl.model.language_model.state_dict())
    lm.lm_head.load_state_dict(vl.lm_head.state_dict())
    lm.generation_config = vl.generation_config
    lm.save_pretrained(out)
    AutoTokenizer.from_pretrained(vlm).save_pretrained(out)
    return out


def smollm2_llava(out: Path) -> Path:
    """SmolLM2-135M-Instruct as a LLaVA-1.5's text model, with a small CLIP tower (30 x 30
    images, 25 tokens each) and a projector of random weights."""
    import torch
    import transformers as t

    from tests.real_models import float_folder, smollm2_gguf

    text_dir = float_folder(smollm2_gguf())
    tok = t.AutoTokenizer.from_pretrained(text_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = t.AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    text.resize_token_embeddings(len(tok))
    vision = t.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=30, patch_size=6,
                                projection_dim=32)  # fmt: skip
    config = t.LlavaConfig(
        vision_config=vision,
        text_config=text.config,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    llava = t.LlavaForConditionalGeneration(config).float()
    llava.model.language_model.load_state_dict(text.model.state_dict())
    llava.lm_head.load_state_dict(text.lm_head.state_dict())
    llava.generation_config = text.generation_config
    llava.save_pretrained(out)
    side = {"shortest_edge": 30}
    images = t.CLIPImageProcessorPil(size=side, crop_size={"height": 30, "width": 30})
    processor = t.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=6,
                                 vision_feature_select_strategy="default",
                                 num_additional_image_tokens=1)  # fmt: skip
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def models(family: str, shape: str, root: Path) -> dict[str, Path]:
    from llmq.tools.model_factory import make_model

    if family == "qwen":
        vlm = make_model(root / "qwen2_5_vl", arch="qwen2_5_vl")
        return {"vlm": vlm, "text": qwen_text_model(vlm, root / "text")}
    vlm = make_model(root / "vlm", arch="llava") if shape == "tiny" else smollm2_llava(root / "vlm")
    return {"vlm": vlm, "text": text_model(vlm, root / "text")}


def cpu_ms(proc) -> float:
    """CPU time a process and its children have used, in ms."""
    return sum(tree(proc.proc.pid).values()) * 1000 / CLK


def bench(base: str, model: str, tokenizer: Path, args, out: Path) -> dict:
    cmd = [LLMQ, "bench", "--base-url", base, "--model", model, "--tokenizer", str(tokenizer),
           "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
           "--output-tokens", str(args.output_tokens), "--warmup", "2", "--json", str(out),
           "--no-progress", "--quiet"]  # fmt: skip
    subprocess.run(cmd, check=True)
    s = json.loads(out.read_text())["summary"]
    assert s["errors"] == 0 and s["short_outputs"] == 0, s
    return {"ttft_ms": s["ttft_s"]["p50"] * 1000, "decode_tok_s": 1 / s["tpot_s"]["p50"]}


def measured(base, model, tokenizer, args, out, worker, api) -> dict:
    """One `llmq bench` run and the CPU its worker and the API spent per request."""
    before = cpu_ms(worker), cpu_ms(api)
    row = bench(base, model, tokenizer, args, out)
    n = args.requests + 2  # with the warm-up requests
    row["worker_cpu_ms"] = (cpu_ms(worker) - before[0]) / n
    row["api_cpu_ms"] = (cpu_ms(api) - before[1]) / n
    return row


def run(args, root: Path) -> None:
    folders = models(args.family, args.shape, root)
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
                                   workers[name], api)  # fmt: skip
                    rows[name].append(row)
                    print(f"round {r} {name:>4}: {line(row)}", flush=True)
            for name, got in rows.items():
                median = {k: statistics.median(x[k] for x in got) for k in got[0]}
                print(f"median {name:>4}: {line(median)}")
        finally:
            kill_all([*workers.values(), api])


def line(row: dict) -> str:
    return (f"TTFT {row['ttft_ms']:.1f} ms, decode {row['decode_tok_s']:.1f} tok/s, CPU a "
            f"request: worker {row['worker_cpu_ms']:.0f} ms, API {row['api_cpu_ms']:.0f} ms")  # fmt: skip


def in_process(args, root: Path) -> None:
    """Each model's engine in this process (the VLM's with its vision runtime attached, as its
    worker runs it), one torch thread: one greedy request at a time, the CPU time per prompt
    step and per decoded token, rounds alternating; medians."""
    import time

    import torch

    from llmq.common.sampling_params import SamplingParams
    from llmq.worker.llm_engine import EngineConfig, LLMEngine
    from llmq.worker.loading.model_loader import load_causal_lm
    from llmq.worker.vision.qwen2_5_vl import load_qwen2_5_vl
    from llmq.worker.vision.runtime import VisionRuntime

    torch.set_num_threads(1)
    folders = models("qwen", "tiny", root)
    lm, encoder = load_qwen2_5_vl(str(folders["vlm"]), torch.float32, "cpu")
    engines = {
        "vlm": LLMEngine(lm, EngineConfig(num_blocks=64)),
        "text": LLMEngine(load_causal_lm(str(folders["text"]), "float32", "cpu"),
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
    p.add_argument("--family", choices=["llava", "qwen"], default="llava")
    p.add_argument("--shape", choices=["tiny", "smollm2"], default="tiny", help="LLaVA's")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--in-process", action="store_true", help="the engines alone, CPU time")
    p.add_argument("--dir", type=Path, help="keep the models and logs here (a new folder)")
    args = p.parse_args()
    if args.in_process and args.family != "qwen":
        p.error("--in-process runs the Qwen2.5-VL engines: add --family qwen")
    if args.shape != "tiny" and args.family != "llava":
        p.error("--shape is LLaVA's")
    go = in_process if args.in_process else run
    if args.dir:
        args.dir.mkdir(parents=True)
        return go(args, args.dir)
    with tempfile.TemporaryDirectory(prefix="vlm-text-") as tmp:
        go(args, Path(tmp))


if __name__ == "__main__":
    main()
