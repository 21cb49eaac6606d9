"""Quantized checkpoints as published (GPTQ, AWQ, compressed-tensors, transformers' fp8): tiny
random Llama and Qwen2 models whose projections are written in each format's documented layout
(by compressed-tensors' own compressors where it has them), loaded through llmq's loader.

(a) the weights read back equal the reference dequantization exactly (compressed-tensors' own
decompression, transformers' own fp8 dequantization; for GPTQ and AWQ the formats' formulas
applied to the integers the test packed),
and the repacked kernel weights equal them too (exactly in float32; the kernel's output within
the bfloat16 rounding of its scales and zeros); (b) the engine's greedy output, batched with a
prefix hit, equals the same model stepped on each prompt alone (int kernels, which compute in
bfloat16), or transformers' ``generate`` on the reference weights (layouts served as float);
(c) what is not implemented is refused, named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from llmq.common.sampling_params import SamplingParams
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.loading.quant_checkpoint.checkpoint import QuantCheckpoint, checkpoint_format
from llmq.worker.runner.linear.quantized_linear import Int4Linear, Int8Linear
from llmq.worker.runner.loaders.checkpoint_weights import (
    ConcatLinear,
    PermutedLinear,
    int4_weight,
    kernel_linear,
)

pytest.importorskip("compressed_tensors")  # its compressors write the reference checkpoints
from tests.worker.quant_checkpoint_writers import WRITERS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _config(arch: str, tiny: LlamaConfig):
    shape = dict(
        vocab_size=tiny.vocab_size,
        bos_token_id=tiny.bos_token_id,
        eos_token_id=tiny.eos_token_id,
        pad_token_id=tiny.pad_token_id,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # the tiny models' (varied greedy output)
        tie_word_embeddings=False,
    )
    if arch == "qwen2":
        return Qwen2Config(**shape, use_sliding_window=False)
    return LlamaConfig(**shape)


def write_checkpoint(folder: Path, llama_dir: Path, arch: str, kind: str, seed: int = 0):
    """A checkpoint of ``kind`` (a key of ``WRITERS``) at ``folder``; returns the reference
    float32 weights of its quantized projections by module name."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, LlamaConfig.from_pretrained(llama_dir)))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    write, quantization_config = WRITERS[kind]
    reference = {}
    generator = torch.Generator().manual_seed(seed + 1)
    for name in list(state):
        module, _, part = name.rpartition(".")
        if part == "weight" and module.rpartition(".")[2] in PROJECTIONS:
            n, k = state[name].shape
            tensors, reference[module] = write(module, n, k, generator)
            del state[name]
            state.update({f"{module}.{p}": t for p, t in tensors.items()})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (llama_dir / name).exists():
            shutil.copy(llama_dir / name, folder / name)
    return reference


def checkpoint_builder(llama_dir: Path, tmp_path_factory):
    """get(arch, kind) -> (folder, reference weights), each built once."""
    built = {}

    def get(arch: str, kind: str):
        if (arch, kind) not in built:
            folder = tmp_path_factory.mktemp(f"{arch}-{kind}")
            built[arch, kind] = folder, write_checkpoint(folder, llama_dir, arch, kind)
        return built[arch, kind]

    return get


@pytest.fixture(scope="module")
def checkpoints(llama_dir, tmp_path_factory):
    return checkpoint_builder(llama_dir, tmp_path_factory)


def _read(folder: Path) -> QuantCheckpoint:
    config = json.loads((folder / "config.json").read_text())
    return QuantCheckpoint(
        [str(folder / "model.safetensors")], checkpoint_format(config["quantization_config"])
    )


KERNELS = {
    "gptq4-actorder": Int4Linear,
    "gptq4-v2-channel": Int4Linear,
    "gptq8-channel": Int8Linear,
    "awq4": Int4Linear,
    "ct-w4a16": Int4Linear,
    "ct-w4a16-asym": Int4Linear,
    "ct-w4a16-actorder": Int4Linear,
    "ct-w8a8": Int8Linear,
}
# fp8 checkpoints -> whether a down projection (128 x 256) takes Fp8Linear: blocks of 128 x 128
# split its rows in two (Fp8BlockLinear); a scale per channel or tensor does not.
FP8_KINDS = {"ct-fp8-channel": True, "ct-fp8-block": False, "fp8-block": False, "fp8-tensor": True}


@pytest.mark.unit
@pytest.mark.parametrize("kind", [*KERNELS, *FP8_KINDS])
def test_weights_read_back_as_the_reference_dequantizes_them(checkpoints, kind):
    folder, reference = checkpoints("llama", kind)
    checkpoint = _read(folder)
    assert sorted(checkpoint.modules) == sorted(reference)
    for module, want in reference.items():
        got = checkpoint.quant(module)
        if kind in FP8_KINDS:
            rows = FP8_KINDS[kind] or not module.endswith("down_proj")
            assert got.kernel() == ("fp8" if rows else "fp8-block"), (module, got.layout())
        else:
            assert got.kernel() is not None, (module, got.layout())
        assert torch.equal(got.dequantize(), want), module


def _slack(weight, x: torch.Tensor) -> torch.Tensor:
    """What the kernel may differ by: scale and zero rounded to bfloat16 (2**-9 of each, taken
    at 2**-8), the output rounded to bfloat16, float32 sums in another order."""
    group = weight.group
    scale = weight.scale.float().repeat_interleave(group, dim=1)
    zero = weight.zero.float().repeat_interleave(group, dim=1)
    rounding = 2**-8 * (scale.abs() * (weight.q - 8).abs() + zero.abs())
    return x.abs() @ rounding.T


@pytest.mark.unit
@pytest.mark.parametrize("kind", list(KERNELS))
def test_fused_kernel_weights_equal_the_reference(checkpoints, kind):
    """q, k, v fused as the fast forward fuses them: the repacked weight (its input columns put
    back where act order moved them) equals the references exactly; the kernel's output is the
    activations' product with them within the kernel's rounding."""
    folder, reference = checkpoints("llama", kind)
    checkpoint = _read(folder)
    names = [f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    parts = [checkpoint.quant(n) for n in names]
    want = torch.cat([reference[n] for n in names])
    linear = kernel_linear(parts, None)
    inner = linear.inner if isinstance(linear, PermutedLinear) else linear
    assert isinstance(inner, KERNELS[kind])
    x = torch.randn(5, want.shape[1], generator=torch.Generator().manual_seed(3))
    x = x.to(torch.bfloat16).float()
    expected = x @ want.T
    if isinstance(inner, Int4Linear):
        weight, order = int4_weight(parts)
        assert (order is not None) == kind.endswith("actorder")
        ours = weight.dequantize()
        if order is not None:
            ours = ours[:, torch.argsort(order)]
        assert torch.equal(ours, want)
        slack = _slack(weight, x if order is None else x[:, order])
    else:  # the int8 kernel's scale rounded to bfloat16
        slack = 2**-8 * (x.abs() @ want.abs().T)
    bound = slack + 2**-8 * expected.abs() + 1e-5 * (x.abs() @ want.abs().T)
    assert bool(((linear(x) - expected).abs() <= bound).all())


@pytest.mark.unit
def test_parts_in_other_column_orders_run_side_by_side(checkpoints):
    """Two act-order weights of one width but other orders (layer 0's query, layer 1's key)
    fused: each part on its own kernel call with its own order; the output is theirs."""
    folder, reference = checkpoints("llama", "gptq4-actorder")
    checkpoint = _read(folder)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]
    parts = [checkpoint.quant(n) for n in names]
    assert not torch.equal(parts[0].column_order(), parts[1].column_order())
    bias = torch.randn(sum(p.shape[0] for p in parts))
    linear = kernel_linear(parts, bias)
    assert isinstance(linear, ConcatLinear)
    assert all(isinstance(p, PermutedLinear) for p in linear.parts)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    want = torch.cat([reference[n] for n in names])
    expected = x.float() @ want.T + bias
    bound = 2**-6 * (x.float().abs() @ want.abs().T) + 1e-4
    assert bool(((linear(x.float()) - expected).abs() <= bound).all())


ENGINE_CASES = [
    ("llama", "gptq4-actorder"),
    ("qwen2", "awq4"),
    ("qwen2", "gptq4-v2-channel"),
    ("llama", "ct-w4a16"),
    ("llama", "ct-w8a8"),
]
OUTPUT_TOKENS = 8


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    first, second, third = (
        torch.randint(3, vocab, (n,), generator=g).tolist() for n in (50, 9, 21)
    )
    # The third shares the first's 40 tokens: a prefix cache hit once the first has run.
    return [first, second, first[:40] + third, third]


def _batched(engine: LLMEngine, prompts) -> tuple[list[list[int]], dict[str, int]]:
    """The first two together, then the other two together (the third hits the first's
    cached prefix); each request's tokens and the most prompt tokens it found cached."""
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    results: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for wave in ((0, 1), (2, 3)):
        for i in wave:
            engine.add_request(str(i), prompts[i], params)
            results[str(i)] = []
        while engine.has_unfinished():
            for out in engine.step():
                results[out.request_id].extend(out.token_ids)
                cached[out.request_id] = max(cached.get(out.request_id, 0), out.num_cached_tokens)
    return [results[str(i)] for i in range(len(prompts))], cached


def _engine(folder: Path, device: str = "cpu") -> LLMEngine:
    model = load_causal_lm(str(folder), "float32", device)
    return LLMEngine(model, EngineConfig(num_blocks=64), eos_token_ids=set())


@pytest.mark.parametrize(("arch", "kind"), ENGINE_CASES)
def test_engine_serves_the_checkpoints_kernels_batched_as_alone(checkpoints, arch, kind):
    folder, _ = checkpoints(arch, kind)
    alone = _engine(folder)
    forward = alone.runner.forward
    assert forward.layout == "checkpoint"
    projection = forward.layers[0].qkv_proj
    inner = projection.inner if isinstance(projection, PermutedLinear) else projection
    assert isinstance(inner, KERNELS[kind])
    assert isinstance(forward.layers[1].mlp.down_proj, (KERNELS[kind], PermutedLinear))
    prompts = _prompts(alone.runner.model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    expected = [alone.generate([p], params)[0] for p in prompts]
    assert all(len(set(t)) >= OUTPUT_TOKENS // 2 for t in expected), expected
    results, cached = _batched(_engine(folder), prompts)
    assert results == expected
    assert cached["2"] >= 32


def _reference_model(folder: Path, reference: dict[str, torch.Tensor]):
    """transformers' float32 model holding the reference weights, built apart from llmq."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    cls = LlamaConfig if config["model_type"] == "llama" else Qwen2Config
    model = AutoModelForCausalLM.from_config(cls.from_dict(config), dtype=torch.float32)
    saved = load_file(folder / "model.safetensors")
    state = {k: v for k, v in saved.items() if k in model.state_dict()}
    state.update({f"{m}.weight": w for m, w in reference.items()})
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize(("arch", "kind"), [("llama", "gptq4-group16"), ("qwen2", "fp8-block")])
def test_a_layout_no_kernel_takes_is_served_as_float_equal_to_generate(checkpoints, arch, kind):
    """GPTQ in groups of 16 columns, and fp8 on a CPU (no fp8 matmuls): dequantized, served as
    the float model; float32 greedy output, batched with a prefix hit, equals ``generate`` on
    the reference weights."""
    folder, reference = checkpoints(arch, kind)
    engine = _engine(folder)
    assert not hasattr(engine.runner.model.config, "llmq_quantization")
    prompts = _prompts(engine.runner.model.config.vocab_size)
    results, cached = _batched(engine, prompts)
    model = _reference_model(folder, reference)
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, results, strict=True):
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=OUTPUT_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            assert out[0, len(prompt) :].tolist() == tokens
    assert cached["2"] >= 32


REFUSED = [
    ({"quant_method": "fp8", "fmt": "e5m2", "activation_scheme": "dynamic"}, "fp8 e5m2"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "hqq", "nbits": 4}, "hqq"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3 bits"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
    (
        {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}},
        },
        "nvfp4-pack-quantized",
    ),
    (
        {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}},
        },
        "float 4-bit",
    ),
]


@pytest.mark.unit
@pytest.mark.parametrize(("config", "named"), REFUSED)
def test_what_is_not_implemented_is_refused_by_name(config, named):
    with pytest.raises(ValueError, match=named):
        checkpoint_format(config)


@pytest.mark.unit
def test_the_loader_refuses_an_unknown_quantization(llama_dir, tmp_path):
    folder = tmp_path / "bnb"
    shutil.copytree(llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization 'bitsandbytes' is not implemented"):
        load_causal_lm(str(folder), "float32", "cpu")
