"""GGUF import: a file holding Q8_0, Q4_K, Q5_K and Q6_K tensors (a Q4_K_M-like mix) loads
with its tokenizer and chat template from the metadata; its Q4_K tensors become int4 weights and
its Q5_K ones 6-bit weights equal to ``gguf``'s own ``dequantize``, its Q8_0 ones int8 weights
as they are, the others int8 weights of transformers' dequantized ones; and the engine serves
it. Every other type a download carries is read as its blocks (each held against ``gguf``'s
``dequantize``), a file of float weights is served as a float folder, and a type llmq does not
read refuses the model by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from llmq.common.model_files import gguf_location, load_tokenizer
from llmq.common.sampling_params import SamplingParams
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.gguf_model import _read_by_quantizer, float_dtype, load_gguf_model
from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.runner.forward.model_support import UnsupportedModel
from llmq.worker.runner.linear.quantize import QuantizedEmbedding
from llmq.worker.runner.linear.quantized_linear import (
    Int4Linear,
    Int6Linear,
    Int8Linear,
    Q6KLinear,
    int_kernel_available,
)
from llmq.worker.runner.loaders import gguf_blocks
from llmq.worker.runner.loaders.gguf_weights import (
    GGUFTensors,
    q4_k_weight,
    q5_k_weight,
    q6_k_weight,
    q8_0_weight,
)
from tests.worker.gguf_writer import (
    MIXED_TYPES,
    Q,
    random_k_blocks,
    source_config,
    write_gguf,
    write_mixed_llama,
)

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def gemma3_gguf(llama_dir, tmp_path_factory) -> Path:
    """A Gemma 3 text model of k-quant widths as a GGUF file as llama.cpp's converter writes
    one (its norms stored as 1 + w): Q4_K and Q5_K projections, a Q6_K table."""
    folder = tmp_path_factory.mktemp("gguf-src")
    config = source_config(llama_dir, folder, Gemma3TextConfig, head_dim=64, sliding_window=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms far from zero: a load that left them at 1 + w shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    types = {"token_embd.weight": Q.Q6_K}
    for i in (0, 1):
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
            types[f"blk.{i}.{t}.weight"] = Q.Q4_K
        types[f"blk.{i}.ffn_down.weight"] = Q.Q5_K
    out = tmp_path_factory.mktemp("gemma3-gguf")
    write_gguf(folder, out / "model-Q4_K_M.gguf", types, arch="gemma3")
    return out


def test_a_folder_or_a_file_is_found(gguf_dir, llama_dir):
    assert gguf_location(str(gguf_dir)) == (str(gguf_dir), "model-Q4_K_M.gguf")
    assert gguf_location(str(gguf_dir / "model-Q4_K_M.gguf")) == (
        str(gguf_dir),
        "model-Q4_K_M.gguf",
    )
    assert gguf_location(str(llama_dir)) is None


K_QUANTS = [(Q.Q4_K, q4_k_weight), (Q.Q5_K, q5_k_weight), (Q.Q6_K, q6_k_weight)]
LARGEST_Q = {Q.Q4_K: 15, Q.Q5_K: 31, Q.Q6_K: 63}


@pytest.mark.parametrize("kind, read", K_QUANTS)
def test_k_quant_blocks_equal_gguf_dequantize(gguf_dir, kind, read):
    reader = gguf.GGUFReader(str(gguf_dir / "model-Q4_K_M.gguf"))
    checked = 0
    for tensor in reader.tensors:
        if tensor.tensor_type != kind:
            continue
        cols, rows = (int(n) for n in tensor.shape[:2])
        ours = read(tensor.data, rows, cols)
        want = torch.from_numpy(gguf.quants.dequantize(tensor.data, kind).astype(np.float32))
        # d * sc * q and dmin * m (Q6_K: d * sc, then times q - 32) round once, as gguf's
        assert torch.equal(ours.dequantize(), want.view(rows, cols)), tensor.name
        checked += 1
    assert checked == sum(t == kind for t in MIXED_TYPES.values())
    # random blocks set every top bit somewhere: q spans the kind's levels
    assert int(ours.q.max()) == LARGEST_Q[kind]


@pytest.mark.parametrize("kind, read", K_QUANTS[1:])
def test_a_q5_k_or_q6_k_table_reads_its_rows_exactly(kind, read):
    rows, cols = 40, 512
    raw = random_k_blocks(kind, rows, cols, np.random.default_rng(1))
    want = gguf.quants.dequantize(raw.reshape(rows, -1), kind).astype(np.float32)
    table = QuantizedEmbedding(read(raw, rows, cols), torch.float32, None)
    assert table.row_reader is not None
    ids = torch.tensor([0, 39, 7, 7])
    assert torch.equal(table(ids), torch.from_numpy(want)[ids])


def test_q8_0_blocks_equal_gguf_dequantize(gguf_dir):
    reader = gguf.GGUFReader(str(gguf_dir / "model-Q4_K_M.gguf"))
    (tensor,) = (t for t in reader.tensors if t.tensor_type == Q.Q8_0)
    cols, rows = (int(n) for n in tensor.shape[:2])
    ours = q8_0_weight(tensor.data, rows, cols)
    want = gguf.quants.dequantize(tensor.data, Q.Q8_0).astype(np.float32).reshape(rows, cols)
    assert ours.grouped and torch.equal(ours.dequantize(), torch.from_numpy(want))


def _transformers_model(gguf_dir: Path) -> torch.nn.Module:
    """The file as transformers loads it whole (every tensor dequantized), marked for llmq's
    GGUF quantizer as ``load_causal_lm`` marks it."""
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file="model-Q4_K_M.gguf", dtype=torch.float32
    ).eval()
    model.config.llmq_gguf_path = str(gguf_dir / "model-Q4_K_M.gguf")
    model.config.llmq_quantization = "gguf"
    return model


def test_the_model_loads_quantized_as_the_file_is(gguf_dir):
    model = load_causal_lm(str(gguf_dir), "float32", "cpu")
    assert model.config.llmq_quantization == "gguf"
    assert model.config.llmq_gguf_lean  # its quantized tensors left in the file
    floats = {n: p.detach() for n, p in _transformers_model(gguf_dir).named_parameters()}
    for name in ("model.norm.weight", "model.layers.1.post_attention_layernorm.weight"):
        assert torch.equal(model.get_parameter(name), floats[name]), name
    file = GGUFTensors(model.config.llmq_gguf_path, 4, 2, lean=True)
    # Q4_K query rows, put back in transformers' order, equal transformers' dequantized ones.
    query = file.int4("blk.0.attn_q.weight").dequantize()
    assert torch.allclose(query, floats["model.layers.0.self_attn.q_proj.weight"], atol=1e-3)
    engine = LLMEngine(model, EngineConfig(num_blocks=32), eos_token_ids=set())
    forward = engine.runner.forward
    assert forward.layout == "gguf"
    layer0, layer1 = forward.layers
    assert isinstance(layer0.qkv_proj, Int4Linear)  # all three Q4_K
    assert isinstance(layer1.qkv_proj, Int8Linear)  # Q6_K attn_v beside Q4_K q, k
    assert isinstance(layer0.o_proj, Int8Linear) and isinstance(layer1.o_proj, Int4Linear)
    if layer0.o_proj.kernel:  # Q8_0: the file's blocks as they are
        q8 = file.int8("blk.0.attn_output.weight")
        rows = layer0.o_proj.rows(torch.arange(q8.q.shape[0]))
        assert torch.equal(rows.q, q8.q) and torch.equal(rows.dequantize(), q8.dequantize())
    # Q5_K, and Q5_K beside Q4_K: 6-bit blocks on llmq's kernel, as the file holds them
    six = Int6Linear if int_kernel_available() else Int8Linear
    assert isinstance(layer0.mlp.down_proj, six) and isinstance(layer0.mlp.gate_up_proj, six)
    assert isinstance(layer1.mlp.gate_up_proj, Int4Linear)
    # Q6_K: its 16-value sub-blocks' scales beside the same panels
    q6k = Q6KLinear if int_kernel_available() else Int8Linear
    assert type(layer1.mlp.down_proj) is q6k and type(forward.lm_head) is q6k
    held = [("blk.0.ffn_down.weight", layer0.mlp.down_proj, file.int6)]
    held += [("blk.1.ffn_down.weight", layer1.mlp.down_proj, file.q6k)]
    held += [("output.weight", forward.lm_head, file.q6k)]
    for name, projection, read in held if six is Int6Linear else []:
        weight = read(name)
        rows = projection.rows(torch.arange(weight.q.shape[0]))
        assert torch.equal(rows.q, weight.q) and torch.equal(rows.dequantize(), weight.dequantize())
    embed = model.model.embed_tokens
    assert embed.row_reader is None  # Q4_K, as the file holds it
    ids = torch.tensor([3, 17, 900])
    table = floats["model.embed_tokens.weight"]
    assert torch.allclose(embed(ids), table[ids], atol=1e-3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = engine.generate([[5, 6, 7, 8], [9, 10]], params)
    assert [len(t) for t in out] == [12, 12]


def _tensors(obj) -> dict[str, torch.Tensor]:
    return {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


def test_the_lean_load_builds_what_the_whole_load_builds(gguf_dir):
    """The forward built from the model loaded without its quantized tensors holds the same
    projections, head and table, bit for bit, as the one built from the model transformers
    loads whole (its Q6_K tensors quantized again from its own dequantized floats, the lean
    load's from ``gguf``'s), and serves the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engines = [
        LLMEngine(model, EngineConfig(num_blocks=32), eos_token_ids=set())
        for model in (
            load_causal_lm(str(gguf_dir), "float32", "cpu"),
            _transformers_model(gguf_dir),
        )
    ]
    lean, whole = (engine.runner.forward for engine in engines)
    pairs = [(lean.lm_head, whole.lm_head)]
    for a, b in zip(lean.layers, whole.layers, strict=True):
        pairs += [(a.qkv_proj, b.qkv_proj), (a.o_proj, b.o_proj)]
        pairs += [(a.mlp.gate_up_proj, b.mlp.gate_up_proj), (a.mlp.down_proj, b.mlp.down_proj)]
    for a, b in pairs:
        assert type(a) is type(b)
        ours, theirs = _tensors(a), _tensors(b)
        assert ours.keys() == theirs.keys() and ours
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), type(a)
    ids = torch.arange(0, 1000, 7)
    assert torch.equal(lean.inner.embed_tokens(ids), whole.inner.embed_tokens(ids))
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    assert engines[0].generate(prompts, params) == engines[1].generate(prompts, params)


def test_a_gemma3_file_loads_lean_with_its_norms_as_transformers_reads_them(gemma3_gguf):
    """Gemma 3's tensor processor (norms stored as 1 + w) applies to the lean load's float
    tensors: its forward equals the one built from transformers' whole load."""
    model = load_causal_lm(str(gemma3_gguf), "float32", "cpu")
    assert model.config.llmq_gguf_lean
    whole = _transformers_model(gemma3_gguf)
    norms = [n for n, _ in whole.named_parameters() if "norm" in n]
    assert len(norms) == 2 * 6 + 1
    for name in norms:
        assert torch.equal(model.get_parameter(name), whole.get_parameter(name)), name
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = [
        LLMEngine(m, EngineConfig(num_blocks=32), eos_token_ids=set()).generate([[5, 6, 7]], params)
        for m in (model, whole)
    ]
    assert outputs[0] == outputs[1]


def test_the_lean_load_takes_only_files_the_quantizer_reads(gguf_dir):
    """The lean load takes this file; a quantized tensor the forward's quantizer does not read
    (a fused ``attn_qkv``, experts) would leave the model to transformers' own loading."""
    assert load_gguf_model(str(gguf_dir), "model-Q4_K_M.gguf", torch.float32) is not None
    assert _read_by_quantizer("blk.3.ffn_down.weight") and _read_by_quantizer("output.weight")
    assert not _read_by_quantizer("blk.3.attn_qkv.weight")
    assert not _read_by_quantizer("blk.3.ffn_down_exps.weight")


def test_tokenizer_and_chat_template_come_from_the_metadata(gguf_dir, llama_dir):
    ours, original = load_tokenizer(str(gguf_dir)), load_tokenizer(str(llama_dir))
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)"
    assert ours.encode(text) == original.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(
        messages, tokenize=False
    )
    assert ours.eos_token_id == original.eos_token_id


def test_the_api_reads_the_tokenizer_without_torch(gguf_dir):
    """The API process loads tokenizers and must never import torch."""
    code = (
        "import sys; from llmq.common.model_files import load_tokenizer; "
        f"load_tokenizer({str(gguf_dir)!r}); assert 'torch' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# Each type's reader, and whether it is exact (else: the error bound of gguf_blocks' coding)
BLOCK_READERS = {
    Q.Q4_0: gguf_blocks.q4_0_weight,
    Q.Q5_0: gguf_blocks.q5_0_weight,
    Q.IQ4_NL: gguf_blocks.iq4_nl_weight,
    Q.Q3_K: gguf_blocks.q3_k_weight,
    Q.IQ4_XS: gguf_blocks.iq4_xs_weight,
    Q.Q4_1: gguf_blocks.q4_1_weight,
    Q.Q5_1: gguf_blocks.q5_1_weight,
}


def _blocks_of(kind, rows: int, cols: int, rng) -> np.ndarray:
    """``kind`` blocks: gguf's own quantizer's of random weights where it has one, else random
    blocks (every bit pattern a block)."""
    if kind in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        weights = rng.normal(0, 0.02, size=(rows, cols)).astype(np.float32)
        weights[:, :32] += 0.03  # a group off zero: Q4_1's and Q5_1's mins far from -d * 8
        return gguf.quants.quantize(weights, kind)
    return random_k_blocks(kind, rows, cols, rng)


@pytest.mark.unit
@pytest.mark.parametrize("kind", list(BLOCK_READERS), ids=lambda k: k.name)
def test_block_readers_equal_gguf_dequantize(kind):
    """Q4_0, Q5_0, IQ4_NL (int8), Q3_K (Q6_K's blocks), Q4_1 and Q5_1 (int4 and 6-bit groups
    with the file's float16 d and m) exactly; IQ4_XS with its group scales rounded to float16."""
    rows, cols = 48, 768
    raw = _blocks_of(kind, rows, cols, np.random.default_rng(int(kind)))
    want = torch.from_numpy(gguf.quants.dequantize(raw, kind).astype(np.float32))
    weight = BLOCK_READERS[kind](raw, rows, cols)
    ours = weight.dequantize()
    if kind != Q.IQ4_XS:
        assert torch.equal(ours, want)
        if kind in (Q.Q4_1, Q.Q5_1):  # every level of the file's q, none past it
            assert int(weight.q.max()) == (15 if kind == Q.Q4_1 else 31)
        return
    # IQ4_XS: |error| <= 2**-11 of the group scale, times |level| <= 127
    step = weight.scale.float().repeat_interleave(32, dim=1).abs()
    assert ((ours - want).abs() <= 2**-11 * 127 * step).all()
    assert not torch.equal(ours, want)  # the float16 rounding shows somewhere


@pytest.fixture(scope="module")
def typed_files(llama_dir, tmp_path_factory) -> dict[str, Path]:
    """Folders each holding one GGUF of a random Llama of k-quant widths: every type llmq reads
    beside its others ("mixed"), all F32, all BF16 projections, and one IQ2_XXS tensor."""
    source = tmp_path_factory.mktemp("gguf-typed-src")
    write_mixed_llama(llama_dir, source, tmp_path_factory.mktemp("unused"))
    layer = {
        0: {"attn_q": Q.Q4_0, "attn_k": Q.Q5_0, "attn_v": Q.IQ4_NL, "attn_output": Q.IQ4_XS},
        1: {"attn_q": Q.Q5_1, "attn_k": Q.Q5_1, "attn_v": Q.Q5_1, "attn_output": Q.Q2_K},
    }
    layer[0].update(ffn_gate=Q.Q4_1, ffn_up=Q.Q4_1, ffn_down=Q.Q3_K)
    layer[1].update(ffn_gate=Q.F16, ffn_up=Q.F16, ffn_down=Q.BF16)
    mixed = {f"blk.{i}.{t}.weight": kind for i, types in layer.items() for t, kind in types.items()}
    mixed.update({"token_embd.weight": Q.Q5_0, "output.weight": Q.IQ4_NL})
    projections = [name for name in mixed if name.startswith("blk.")]
    files = {
        "mixed": mixed,
        "f32": {},
        "bf16": {name: Q.BF16 for name in [*projections, "token_embd.weight", "output.weight"]},
        "iq2": {**mixed, "blk.1.attn_output.weight": Q.IQ2_XXS},
    }
    out = {}
    for name, types in files.items():
        out[name] = tmp_path_factory.mktemp(f"gguf-{name}")
        write_gguf(source, out[name] / f"model-{name}.gguf", types)
    out["source"] = source
    return out


def test_every_served_type_becomes_its_form(typed_files):
    """Each type of a file becomes the form gguf_blocks.py names for it, holding the weights
    ``gguf`` dequantizes (exactly where the form is exact), float tensors kept float; the
    engine serves the file."""
    folder = typed_files["mixed"]
    model = load_causal_lm(str(folder), "float32", "cpu")
    assert model.config.llmq_quantization == "gguf" and model.config.llmq_gguf_lean
    engine = LLMEngine(model, EngineConfig(num_blocks=32), eos_token_ids=set())
    forward = engine.runner.forward
    kernel = int_kernel_available()
    layer0, layer1 = forward.layers
    qkv = ["attn_q", "attn_k", "attn_v"]
    forms = {  # projection, its form (on llmq's kernels, else torch's), its tensors, exact
        "qkv0": (layer0.qkv_proj, Int8Linear, qkv, True),
        "o0": (layer0.o_proj, Int8Linear, ["attn_output"], False),
        "gate_up0": (layer0.mlp.gate_up_proj, Int4Linear, ["ffn_gate", "ffn_up"], True),
        "down0": (layer0.mlp.down_proj, Q6KLinear if kernel else Int8Linear, ["ffn_down"], True),
        "qkv1": (layer1.qkv_proj, Int6Linear if kernel else Int4Linear, qkv, True),
        "o1": (layer1.o_proj, Int8Linear, ["attn_output"], False),  # Q2_K: int8 of its floats
    }
    file = GGUFTensors(str(folder / "model-mixed.gguf"), 4, 2, lean=True)
    for key, (projection, form, tensors, exact) in forms.items():
        assert type(projection) is form, key
        index = int(key[-1])
        want = torch.cat([file.floats(f"blk.{index}.{t}.weight", torch.float32) for t in tensors])
        if not kernel:
            continue  # torch's kernels hold their own forms (per-channel int8, bfloat16 steps)
        if hasattr(projection, "rows"):  # the rows the kernel's panels hold
            ours = projection.rows(torch.arange(want.shape[0])).dequantize()
        else:  # int4's panels are not read back: the blocks they were built from
            ours = torch.cat([file.int4(f"blk.{index}.{t}.weight").dequantize() for t in tensors])
        error = (ours - want).square().mean().sqrt() / want.square().mean().sqrt()
        assert torch.equal(ours, want) if exact else error < 0.02, (key, float(error))
    # F16 and BF16 tensors: the model's float weights, as the file holds them
    for projection, tensors in [(layer1.mlp.gate_up_proj, ["ffn_gate", "ffn_up"])] + [
        (layer1.mlp.down_proj, ["ffn_down"])
    ]:
        assert not hasattr(projection, "bits")
        want = torch.cat([file.floats(f"blk.1.{t}.weight", torch.float32) for t in tensors])
        assert torch.equal(projection.weight.float(), want)
    embed = model.model.embed_tokens  # Q5_0: int8 as the file holds it
    ids = torch.tensor([3, 17, 900])
    assert torch.equal(embed(ids), file.floats("token_embd.weight", torch.float32)[ids])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = engine.generate([[5, 6, 7, 8], [9, 10]], params)
    assert [len(t) for t in out] == [8, 8]


def test_a_file_of_float_weights_is_served_as_its_float_folder(typed_files, llama_dir):
    """An F32 file is not quantized again: served in float32 as the folder it was written from
    is, the same greedy tokens; a BF16 file is served in bfloat16 where the CPU has it."""
    model = load_causal_lm(str(typed_files["f32"]), "auto", "cpu")
    assert model.config.llmq_gguf_float and not hasattr(model.config, "llmq_quantization")
    assert model.dtype == torch.float32
    folder = load_causal_lm(str(typed_files["source"]), "float32", "cpu")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    outputs = [
        LLMEngine(m, EngineConfig(num_blocks=32), eos_token_ids=set()).generate(prompts, params)
        for m in (model, folder)
    ]
    assert outputs[0] == outputs[1]
    bf16 = gguf.GGUFReader(str(typed_files["bf16"] / "model-bf16.gguf"))
    assert float_dtype(bf16, native_bfloat16=True) == "bfloat16"
    assert float_dtype(bf16, native_bfloat16=False) == "float32"  # exact, and fast there
    mixed = gguf.GGUFReader(str(typed_files["mixed"] / "model-mixed.gguf"))
    assert float_dtype(mixed, native_bfloat16=True) is None


def test_a_type_llmq_does_not_read_refuses_the_model_by_name(typed_files):
    model = load_causal_lm(str(typed_files["iq2"]), "float32", "cpu")
    with pytest.raises(UnsupportedModel, match="IQ2_XXS"):
        LLMEngine(model, EngineConfig(num_blocks=32), eos_token_ids=set())
