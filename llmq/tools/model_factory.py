"""`llmq make-model`: a model with random weights and a locally trained tokenizer.

No machine of this project can download weights, so tests, benchmarks and offline smoke tests
use a folder written here with ``save_pretrained``; it then loads through exactly the code path a
Hugging Face model id takes. The init is wide (``initializer_range`` 0.2, random q/k/v biases for
Qwen2) because a default-init random model repeats one token, which would hide attention bugs.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Literal

# `llmq make-model --arch`; the coverage tests build every architecture of model_archs.ARCHS.
CLI_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "llava", "llava_next", "idefics3")
CLI_ARCHS += ("qwen2_5_vl",)  # vision_qwen.py
CLI_ARCHS += ("gemma3_vl",)  # vision_gemma3.py: Gemma 3's vision-language model
VISION_ARCHS = ("llava", "llava_next", "idefics3", "qwen2_5_vl", "gemma3_vl")
Arch = str
Size = Literal["tiny", "smollm2-135m", "moe-1b", "llama-1b", "llama-8b"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
# ChatML, and tools as real templates render them (Hermes style, as Qwen2.5's): the schemas
# in a system turn, calls in <tool_call> tags, results as <tool_response>; without tools the
# prompt is plain ChatML.
CHAT_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages and messages[0].role == "system" %}{{ messages[0].content }}

{% endif %}You may call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if tools and loop.first and message.role == "system" %}
{%- elif message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content or "" }}
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

SHAPES: dict[Size, dict] = {
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
    # The shape of HuggingFaceTB/SmolLM2-135M(-Instruct).
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        initializer_range=0.02,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
    # The shape of Llama-3.2-1B with SmolLM2's vocabulary: 1.07B parameters (tied head).
    "llama-1b": dict(
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        initializer_range=0.02,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    # The shape of Llama-3.1-8B with SmolLM2's vocabulary: 7.4B parameters (head untied).
    "llama-8b": dict(
        vocab_size=49152,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        initializer_range=0.02,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    # Qwen3-MoE only: 8 experts, 2 active a token; 1.02B parameters, 0.29B of them active a
    # token (attention 63M, two experts a layer 226M) besides the tied 50M embedding and head.
    "moe-1b": dict(
        vocab_size=49152,
        hidden_size=1024,
        intermediate_size=3072,
        moe_intermediate_size=1536,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
        initializer_range=0.02,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
}

# Characters of stdlib source fed to the tokenizer trainer, per target vocabulary size.
_TEXT_BUDGET = {1024: 2_000_000, 49152: 40_000_000}


def _training_text(budget: int):
    """Python's own stdlib sources: local, deterministic, plenty of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    used = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        used += len(text)
        if used >= budget:
            return


@functools.lru_cache(maxsize=2)
def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (so every string round-trips) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(_TEXT_BUDGET.get(vocab_size, 40_000_000)), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


# Beyond the tiny size: the families' own options at the size's shape (head dim 64 for 9 heads
# of hidden 576). Gemma 3 as its small models are: a window of 512 tokens on five layers in
# six, their own rotary base (rope_local_base_freq), query_pre_attn_scalar the head dim.
_FAMILY_SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3": ("Qwen3Config", dict(head_dim=64)),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(head_dim=64, query_pre_attn_scalar=64, sliding_window=512, rope_local_base_freq=1e4),
    ),
}


def _family_config(arch: str, shape: dict, ids: dict):
    import transformers

    class_name, options = _FAMILY_SHAPES[arch]
    return getattr(transformers, class_name)(**shape, **options, **ids)


def _moe_config(arch: str, shape: dict, ids: dict):
    from transformers import Qwen3MoeConfig

    if arch != "qwen3_moe":
        raise ValueError(f"the moe-1b size is a qwen3_moe shape, not {arch!r}")
    return Qwen3MoeConfig(**shape, **ids)


def _config(arch: str, size: Size, shape: dict, ids: dict):
    """The transformers config of ``arch`` at ``size`` (``shape``), with the tokenizer's ids."""
    from transformers import LlamaConfig, Qwen2Config

    from llmq.tools.model_archs import ARCHS, tiny_config

    if size == "moe-1b":
        return _moe_config(arch, shape, ids)
    if arch == "llama":
        return LlamaConfig(**shape, **ids)
    if arch == "qwen2":
        return Qwen2Config(**shape, **ids, use_sliding_window=False)
    if arch in ARCHS and size == "tiny":
        config = tiny_config(arch, **ids)
        config.vocab_size = shape["vocab_size"]
        return config
    if arch in _FAMILY_SHAPES:
        return _family_config(arch, shape, ids)
    raise ValueError(f"unknown arch {arch!r} at size {size}; choose one of {', '.join(ARCHS)}")


def make_vision_model(path: Path, arch: str, size: Size, shape, ids, tokenizer, seed: int) -> Path:
    """A tiny LLaVA-1.5, LLaVA-NeXT or Idefics3 on ``make_model``'s text shape and tokenizer."""
    from llmq.tools.vision_models import make_idefics3, make_llava
    from llmq.tools.vision_qwen import make_qwen2_5_vl

    if size != "tiny":
        raise ValueError(f"{arch} is built at the tiny size only")
    if arch == "idefics3":
        return make_idefics3(path, shape, ids, tokenizer, seed)
    if arch == "qwen2_5_vl":
        return make_qwen2_5_vl(path, shape, ids, tokenizer, seed)
    if arch == "gemma3_vl":  # Gemma 3's tiny text model with a SigLIP tower and its processor
        from llmq.tools.vision_gemma3 import make_gemma3_vl

        return make_gemma3_vl(path, ids, tokenizer, seed)
    return make_llava(path, shape, ids, tokenizer, seed, anyres=arch == "llava_next")


def make_model(
    path: str | Path,
    arch: Arch = "llama",
    size: Size = "tiny",
    seed: int = 0,
    device: str = "cpu",
    context: int | None = None,
) -> Path:
    """Write a random-weight model and its tokenizer to ``path``; return the path. ``arch``:
    llama, qwen2, qwen3 or gemma3 at either size, or any architecture of ``model_archs.ARCHS``
    (gemma3 is gemma3_text), llava or llava_next (with its processor) at the tiny size.
    ``device``: where the random weights are drawn (a GPU draws the 8B shape's in seconds;
    other weights than the CPU's). ``context``: the
    model's longest sequence in tokens (its ``max_position_embeddings``), instead of the size's
    own; the weights drawn are the same."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from llmq.tools.model_archs import perturb

    arch = "gemma3_text" if arch == "gemma3" else arch
    path = Path(path)
    shape = dict(SHAPES[size])
    tokenizer = train_tokenizer(shape["vocab_size"])
    shape["vocab_size"] = len(tokenizer)
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch in VISION_ARCHS:  # tower, processor, template
        return make_vision_model(path, arch, size, shape, ids, tokenizer, seed)
    config = _config(arch, size, shape, ids)
    if context is not None:
        config.max_position_embeddings = context
    # Marks the folder as a demo: /v1/models and the playground label it "random weights".
    config.llmq_random_weights = True
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":
        # Biases start at zero; random ones make a bias bug visible in the exactness tests.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, shape["initializer_range"])
    elif arch != "llama":
        # Norms, biases, sinks: random, so that a feature the engine ignored shows.
        perturb(model, seed=seed)
    if size != "tiny":
        model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(**ids)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
