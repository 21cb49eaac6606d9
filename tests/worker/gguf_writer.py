"""GGUF files for the importer's tests, written with the ``gguf`` package's writer from a
transformers Llama folder: the metadata llama.cpp's converter writes (hyperparameters, a GPT-2
style BPE tokenizer, the chat template), the query and key rows permuted as it permutes them,
and each tensor in the type asked for.

``gguf.quants`` quantizes Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 (so those tensors are the model's)
and writes F16 and BF16; it has no k-quant or IQ4 encoder, so Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL and IQ4_XS tensors (and a type llmq refuses, IQ2_XXS) are random blocks (valid by
construction: any bits are a block, given finite scales), which is what the importer's
exactness needs: the same file read by llmq and by ``gguf``'s ``dequantize``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

Q = gguf.GGMLQuantizationType
# the byte offsets of a random block's fp16 scales (d, then a min's step)
_K_BLOCKS = {
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.Q3_K: (108,),
    Q.Q2_K: (80, 82),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
    Q.IQ2_XXS: (0,),
}
_MIDDLE_CODE = {Q.Q4_K: 7.5, Q.Q5_K: 15.5, Q.Q2_K: 1.5}  # q in 0..15, 0..31, 0..3
# the types gguf's own quantizer writes from the model's weights
_QUANTIZED = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16)
# Gemma 3's norms beside llama's (its input and post-attention norms are llama's names)
_GEMMA3_NORMS = {
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


# Q4_K_M's pattern at two layers: Q6_K for the head, layer 1's attn_v and ffn_down; Q5_K for
# layer 0's ffn_down and (beside a Q4_K ffn_gate) ffn_up; a Q8_0 attn_output.
MIXED_TYPES = {
    "token_embd.weight": Q.Q4_K,
    "output.weight": Q.Q6_K,
    **{f"blk.{i}.{t}.weight": Q.Q4_K for i in (0, 1) for t in ("attn_q", "attn_k", "attn_v")},
    **{f"blk.{i}.{t}.weight": Q.Q4_K for i in (0, 1) for t in ("ffn_gate", "ffn_up")},
    "blk.1.attn_v.weight": Q.Q6_K,
    "blk.1.ffn_down.weight": Q.Q6_K,
    "blk.0.ffn_down.weight": Q.Q5_K,
    "blk.0.ffn_up.weight": Q.Q5_K,
    "blk.0.attn_output.weight": Q.Q8_0,
    "blk.1.attn_output.weight": Q.Q4_K,
}


def source_config(llama_dir: Path, folder: Path, config_class, **shape):
    """``folder`` given the tiny model's tokenizer, and a config of k-quant widths (256 wide:
    a k-quant block) with its vocabulary, for a model to be written there."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (llama_dir / name).exists():
            shutil.copy(llama_dir / name, folder / name)
    tiny = LlamaConfig.from_pretrained(llama_dir)
    return config_class(
        **{k: getattr(tiny, k) for k in ("vocab_size", "bos_token_id", "eos_token_id")},
        pad_token_id=tiny.pad_token_id,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        **shape,
    )


def write_mixed_llama(llama_dir: Path, source: Path, out: Path) -> Path:
    """A random Llama of k-quant widths with the tiny model's tokenizer, written to ``source``,
    and ``out``: a folder holding it as one GGUF file of ``MIXED_TYPES``."""
    config = source_config(llama_dir, source, LlamaConfig, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(source)
    write_gguf(source, out / "model-Q4_K_M.gguf", MIXED_TYPES)
    return out


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = hf.split(".", 3)
    module = rest.removesuffix(".weight")
    names = {**_NAMES, **_GEMMA3_NORMS} if arch == "gemma3" else _NAMES
    return f"blk.{index}.{names[module]}.weight"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's query/key row order."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def random_k_blocks(kind, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random ``kind`` blocks of weights about the model's size (small positive fp16 scales),
    centred on zero: Q4_K's, Q5_K's and Q2_K's ``min`` step is the middle code's share of ``d``
    (the random scales and mins are alike), or every weight would lean one way and a model of
    them answer every prompt alike."""
    scale_at = _K_BLOCKS[kind]
    values, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // values, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 4e-4, size=blocks.shape[0])
    steps = (d, d * _MIDDLE_CODE[kind]) if len(scale_at) == 2 else (d,)
    for offset, step in zip(scale_at, steps, strict=True):
        blocks[:, offset : offset + 2] = step.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def write_gguf(
    folder: Path,
    out: Path,
    types: dict[str, Q],
    seed: int = 0,
    arch: str = "llama",
    vocab_size: bool = True,
) -> Path:
    """``folder``'s Llama (or Gemma 3 text model: ``arch="gemma3"``) as a GGUF file; ``types``:
    GGUF tensor name -> type (others F32). ``vocab_size``: whether the hyperparameters name it
    (llama.cpp's Gemma 3 files do not: the vocabulary's length says it)."""
    config = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), arch)
    if arch == "gemma3":
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
        w.add_sliding_window(config["sliding_window"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    rope = config.get("rope_parameters") or config  # transformers 5 nests it
    rope = rope.get("full_attention", rope)  # and Gemma 3's per kind of layer
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if vocab_size:
        w.add_vocab_size(config["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [specials.get(i, t) for i, (t, _) in enumerate(vocab)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_pad_token_id(config["pad_token_id"])
    w.add_add_bos_token(False)
    template = folder / "chat_template.jinja"  # transformers 5 keeps it beside the config
    w.add_chat_template(template.read_text() if template.exists() else tok_config["chat_template"])
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for hf, tensor in sorted(load_file(str(folder / "model.safetensors")).items()):
        name = gguf_name(hf, arch)
        data = tensor.astype(np.float32)
        kind = heads.get(name.split(".")[-2]) if arch == "llama" else None
        if kind is not None:
            data = _permute(data, kind)
        if arch == "gemma3" and "norm" in name:  # llama.cpp's converter stores 1 + w
            data = data + 1
        wanted = types.get(name, Q.F32)
        if wanted in _K_BLOCKS:
            raw = random_k_blocks(wanted, data.shape[0], data.shape[1], rng)
            w.add_tensor(name, raw, raw_dtype=wanted)
        elif wanted == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        elif wanted in _QUANTIZED:
            w.add_tensor(name, gguf.quants.quantize(data, wanted), raw_dtype=wanted)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
