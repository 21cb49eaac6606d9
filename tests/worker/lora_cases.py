"""LoRA cases shared by the engine's adapter tests: a tiny base model, PEFT adapters of it
(random A and B, so each changes the output), prompts, and the reference of every prompt
under each adapter from PEFT's own ``generate``."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.sequence import LoraRef
from llmq.worker.llm_engine import LLMEngine
from tests.lora_model import make_adapter
from tests.worker.test_engine_exact import reference_generate

EOS = 2
# name -> (rank, make_adapter options): ranks 8 and 16 on all seven projections, rsLoRA, and
# a subset of the targets (a fused projection with some of its parts only).
ADAPTERS = {
    "r8": (8, {}),
    "r16": (16, {}),
    "rs8": (8, {"use_rslora": True, "lora_alpha": 32}),
    "part16": (16, {"targets": ["q_proj", "v_proj", "down_proj"]}),
}
LENGTHS = [3, 9, 17, 30, 47, 64, 5, 21, 33, 12, 40, 7, 26, 55, 15, 70]
MAX_TOKENS = 10


@dataclass
class LoraCase:
    base: str  # the base model's folder
    adapters: dict[str, LoraRef]
    prompts: list[list[int]]
    # adapter name ("" for the base) -> each prompt's greedy tokens under it
    expected: dict[str, list[list[int]]] = field(default_factory=dict)

    def ref(self, name: str) -> LoraRef | None:
        return self.adapters[name] if name else None


def build_adapters(base: Path, root: Path, seed: int = 0) -> dict[str, LoraRef]:
    refs = {}
    for i, (name, (rank, options)) in enumerate(ADAPTERS.items()):
        folder = make_adapter(base, root / name, rank=rank, seed=seed + i, **dict(options))
        refs[name] = LoraRef(name, str(folder))
    return refs


def make_prompts(vocab_size: int, lengths=LENGTHS, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def peft_model(base: str, adapter: str | None, merged: bool = False):
    """The float32 base model with ``adapter`` applied by PEFT (merged into the weights where
    asked); the base alone for None."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is None:
        return model
    model = PeftModel.from_pretrained(model, adapter)
    return model.merge_and_unload() if merged else model


def references(model, prompts, n: int = MAX_TOKENS) -> list[list[int]]:
    with torch.inference_mode():
        return [reference_generate(model, p, n) for p in prompts]


def lora_case(base: Path, root: Path) -> LoraCase:
    adapters = build_adapters(base, root)
    base_model = peft_model(str(base), None)
    prompts = make_prompts(base_model.config.vocab_size)
    case = LoraCase(str(base), adapters, prompts)
    case.expected[""] = references(base_model, prompts)
    for name, ref in adapters.items():
        case.expected[name] = references(peft_model(str(base), ref.path), prompts)
    return case


def params(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)
    errors: dict[str, object] = field(default_factory=dict)


def drive(engine: LLMEngine, requests: dict[str, tuple[list[int], LoraRef | None]]) -> Run:
    """Add every request at once, step until all finish (checking the block manager each
    step); each request's tokens, cached prompt tokens and error."""
    run = Run()
    for rid, (prompt, lora) in requests.items():
        engine.add_request(rid, prompt, params(), lora=lora)
        run.tokens[rid] = []
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            run.tokens[out.request_id].extend(out.token_ids)
            run.cached[out.request_id] = max(
                run.cached.get(out.request_id, 0), out.num_cached_tokens
            )
            if out.error is not None:
                run.errors[out.request_id] = out.error
        engine.block_manager.check_invariants(list(engine.requests.values()))
        steps += 1
        assert steps < 2000, "the engine does not finish"
    assert engine.block_manager.num_used_blocks == 0
    return run


def mixed_requests(case: LoraCase, names: list[str]) -> dict[str, tuple[list[int], LoraRef | None]]:
    """Prompt i under ``names[i % len(names)]`` ("" for the base model), as request "i"."""
    return {str(i): (p, case.ref(names[i % len(names)])) for i, p in enumerate(case.prompts)}


def mismatches(case: LoraCase, run: Run, names: list[str]) -> list:
    out = []
    for i in range(len(case.prompts)):
        name = names[i % len(names)]
        if run.tokens[str(i)] != case.expected[name][i]:
            out.append((i, name, case.expected[name][i], run.tokens[str(i)]))
    return out


def rewritten(source: str, dest: Path, change) -> str:
    """A copy of the adapter folder ``source`` at ``dest`` with its tensors passed through
    ``change`` (a dict -> dict function)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    tensors = load_file(Path(source) / "adapter_model.safetensors")
    save_file(change(dict(tensors)), dest / "adapter_model.safetensors")
    return str(dest)


def renamed(old: str, new: str):
    """A ``rewritten`` change: every tensor name with ``old`` replaced by ``new``."""
    return lambda tensors: {k.replace(old, new): v for k, v in tensors.items()}


def bad_adapters(case: LoraCase, root: Path) -> dict[str, tuple[str, str]]:
    """Adapters a worker must refuse: name -> (folder, what the error names). For an engine
    whose max_lora_rank is 8."""
    import shutil

    good = case.adapters["r8"].path
    corrupt = root / "corrupt"
    shutil.copytree(good, corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    base = Path(case.base)

    def wrong_shape(tensors):
        key = next(k for k in tensors if "q_proj.lora_A" in k)
        tensors[key] = tensors[key][:, :-1].contiguous()
        return tensors

    return {
        "rank16": (case.adapters["r16"].path, "rank 16 is over"),
        "dora": (str(make_adapter(base, root / "dora", use_dora=True)), "use_dora"),
        "saved": (
            str(make_adapter(base, root / "saved", modules_to_save=["lm_head"])),
            "modules_to_save",
        ),
        "layer": (rewritten(good, root / "layer", renamed("layers.1.", "layers.9.")), "layer 9"),
        "target": (
            rewritten(good, root / "target", renamed("q_proj", "qkv_proj")),
            "qkv_proj, which the base lacks",
        ),
        "shape": (rewritten(good, root / "shape", wrong_shape), "do not fit"),
        "corrupt": (str(corrupt), "unreadable"),
        "missing": (str(root / "nothing-here"), "no adapter folder"),
    }
