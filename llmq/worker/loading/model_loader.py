"""Loading models for the worker: a Hugging Face id or a local folder, the same code path (the
tokenizer and the files themselves: ``common/model_files.py``)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmq.common.model_files import gguf_location, model_file, quiet_transformers
from llmq.worker.loading.gguf_model import gguf_read_once, load_gguf_model

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32", "bfloat16", "float16"}


def resolve_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def cpu_has_native_bfloat16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX on x86, the BF16
    extension on Arm). Without it oneDNN emulates bfloat16 matmuls, several times slower than
    float32 (docs/performance.md)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = set(value.split())
            return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    return False


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """auto: float16 on CUDA; on CPU bfloat16 where the CPU has it in hardware (about twice
    float32's speed there), else float32."""
    import torch

    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.float16
        return torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(sorted(_DTYPES))}")
    return getattr(torch, dtype)


def load_causal_lm(
    model: str, dtype: str = "auto", device: str = "auto", quantization: str = "none"
):
    """The model; ``quantization`` (int8, int4, fp8) is recorded on its config, and the worker's
    forward quantizes the weights as it builds (``worker/runner/linear/quantize.py``). A GGUF file
    (``gguf_location``), and a quantized checkpoint whose layout a kernel here takes, are served
    as the file is: ``quantization`` does not apply. A quantized checkpoint served as float (an
    FP8 one on a CPU, say) is quantized by ``quantization`` as a float checkpoint would be."""
    quiet_transformers()
    started = time.monotonic()
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    log.info("loading %s (%s on %s)", model, torch_dtype, device)
    lm, quantization = _causal_lm(model, torch_dtype, device, quantization, dtype == "auto")
    lm.to(device).eval()
    lm.requires_grad_(False)
    if quantization != "none":
        lm.config.llmq_quantization = quantization
    log.info("load phase: weights of %s in %.2f s", model, time.monotonic() - started)
    return lm


def _causal_lm(
    model: str, torch_dtype: torch.dtype, device: str, quantization: str, auto: bool = False
):
    """The model as its source holds it, and the quantization its forward is to apply
    (``auto``: the dtype was not set)."""
    from transformers import AutoModelForCausalLM

    gguf = gguf_location(model)
    if gguf is not None:
        # Its quantized tensors left in the file for the forward's kernels (gguf_model.py), or,
        # where that cannot be, dequantized by transformers and read again by the forward; a
        # file of float weights in its own dtype where none was set.
        native = auto and cpu_has_native_bfloat16()
        with gguf_read_once():
            lm = load_gguf_model(*gguf, torch_dtype, auto, native) if device == "cpu" else None
            if lm is None:
                lm = AutoModelForCausalLM.from_pretrained(
                    gguf[0], gguf_file=gguf[1], dtype=torch_dtype
                )
        lm.config.llmq_gguf_path = str(Path(gguf[0]) / gguf[1])
        # a file of float weights is served as a float folder is
        quantization = quantization if getattr(lm.config, "llmq_gguf_float", False) else "gguf"
    elif (quantized := quantization_config(model)) is not None:
        lm = load_quantized_checkpoint(model, quantized, torch_dtype, device)
        if hasattr(lm.config, "llmq_checkpoint_files"):
            if quantization != "none":
                log.warning(
                    "LLMQ_QUANTIZATION=%s does not apply: %s is served on its own quantized "
                    "weights",
                    quantization,
                    model,
                )
            quantization = "checkpoint"
        # Served as float (no kernel here takes its layout): LLMQ_QUANTIZATION, if set,
        # quantizes the dequantized weights, as it would a float checkpoint's.
    else:
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    return lm, quantization


def quantization_config(model: str) -> dict | None:
    """config.json's ``quantization_config`` (a checkpoint published quantized); None where
    there is none."""
    path = model_file(model, "config.json")
    if path is None:
        return None
    with open(path) as f:
        return json.load(f).get("quantization_config")


def _weight_files(model: str) -> list[str]:
    index = model_file(model, "model.safetensors.index.json")
    if index is None:
        single = model_file(model, "model.safetensors")
        if single is None:
            raise ValueError(f"{model}: a quantized checkpoint is read from safetensors files")
        return [single]
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    return [model_file(model, shard) for shard in shards]


def load_quantized_checkpoint(
    model: str, quantized: dict, dtype: torch.dtype, device: str | torch.device = "cpu"
):
    """A checkpoint published quantized (compressed-tensors, GPTQ, AWQ, fp8: ``common/
    quant_checkpoint``), built as its float model (the quantization_config taken off, so that
    transformers does not look for its own kernels' packages) holding the dequantized weights.
    Where torch's int4/int8 kernels (or, on ``device``, its fp8 matmuls) take any of its
    projections, the worker's forward reads them again from the files
    (``worker/runner/loaders/checkpoint_weights.py``); the rest stay float."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from llmq.worker.loading.quant_checkpoint.checkpoint import QuantCheckpoint, checkpoint_format
    from llmq.worker.loading.quant_checkpoint.fp8_tensor import serves

    fmt = checkpoint_format(quantized)  # refuses what is not implemented, naming it
    files = _weight_files(model)
    state, kernels = QuantCheckpoint(files, fmt).float_state_dict(dtype)
    config = AutoConfig.from_pretrained(model)
    del config.quantization_config
    lm = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
        None, config=config, state_dict=state, dtype=dtype
    )
    if model_file(model, "generation_config.json") is not None:
        lm.generation_config = GenerationConfig.from_pretrained(model)
    floats = sum(kernels.pop(k) for k in list(kernels) if not serves(k, device))
    if kernels:
        lm.config.llmq_checkpoint_files = files
        lm.config.llmq_checkpoint_quantization = quantized
    if floats:
        log.info(
            "%s: %d quantized projections of a layout torch's kernels do not take on %s "
            "(4-bit groups not a multiple of 32, 8-bit not per channel and symmetric, fp8 "
            "where the device has no fp8 matmuls of its scales): dequantized, served as float",
            fmt.description,
            floats,
            device,
        )
    return lm


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """Every id that ends generation: the generation config's and the tokenizer's."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@dataclass(slots=True)
class EmbeddingConfig:
    """How a sentence-transformers style model turns token states into one vector."""

    pooling: str = "mean"  # mean, cls, max, lasttoken, mean_sqrt_len
    normalize: bool = False
    max_seq_length: int | None = None
    matryoshka: bool = False  # whether truncating the vector (`dimensions`) is meaningful


def embedding_config(model: str) -> EmbeddingConfig | None:
    """The pooling setup of a sentence-transformers model (modules.json + its Pooling module);
    None for any other model."""
    modules_path = model_file(model, "modules.json")
    if modules_path is None:
        return None
    with open(modules_path) as f:
        modules = json.load(f)
    cfg = EmbeddingConfig()
    for module in modules:
        kind = module.get("type", "")
        if kind.endswith("Pooling"):
            path = model_file(model, f"{module.get('path', '1_Pooling')}/config.json")
            if path:
                with open(path) as f:
                    pooling = json.load(f)
                for key, mode in (
                    ("pooling_mode_cls_token", "cls"),
                    ("pooling_mode_max_tokens", "max"),
                    ("pooling_mode_lasttoken", "lasttoken"),
                    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
                    ("pooling_mode_mean_tokens", "mean"),
                ):
                    if pooling.get(key):
                        cfg.pooling = mode
                        break
        elif kind.endswith("Normalize"):
            cfg.normalize = True
    st_path = model_file(model, "sentence_bert_config.json")
    if st_path:
        with open(st_path) as f:
            cfg.max_seq_length = json.load(f).get("max_seq_length")
    readme = model_file(model, "README.md")
    if readme:
        with open(readme, errors="replace") as f:
            cfg.matryoshka = "matryoshka" in f.read().lower()
    return cfg


def load_encoder(model: str, dtype: str = "auto", device: str = "auto"):
    """An encoder for embeddings. auto dtype is float32: embeddings are compared by cosine,
    where bfloat16 rounding shows."""
    from transformers import AutoModel

    return load_float32_auto(AutoModel, "encoder", model, dtype, device)


def load_float32_auto(auto_class, what: str, model: str, dtype: str, device: str):
    """``auto_class``'s model of ``model`` for inference, float32 unless ``dtype`` says
    otherwise (encoders' outputs are compared closely, where bfloat16 rounding shows)."""
    import torch

    quiet_transformers()
    device = resolve_device(device)
    torch_dtype = torch.float32 if dtype == "auto" else resolve_dtype(dtype, device)
    log.info("loading %s %s (%s on %s)", what, model, torch_dtype, device)
    loaded = auto_class.from_pretrained(model, dtype=torch_dtype)
    loaded.to(device).eval()
    loaded.requires_grad_(False)
    return loaded
