"""Quantization at load (``LLMQ_QUANTIZATION``): llmq's decoder forward with its projections,
head and embedding table in 8 or 4 bits (``quantized_linear``; on CUDA int8 and fp8 as W8A8,
``dynamic_quantized``).

- ``int8``: every projection and the head int8, a scale per group of 32 (per output channel on
  torch's kernel; with a minimum per group, ``Int8Groups``, where ``LLMQ_INT8_MIN``); the
  embedding table alike, rows dequantized as they are looked up (as
  llama.cpp's Q8_0 keeps ``token_embd`` in Q8_0 and reads its rows with ``get_rows``).
- ``int4``: projections 4-bit in groups of 32 (``Int4Blocks``: a group's scale and base coded
  in 8 bits per super-block of 256, 4.625 bits a weight), except the tensors kept at 6 bits
  (``Int6Blocks``, 6.625 bits a weight; int8 where llmq's kernels do not serve), as Q4_K_M
  keeps them in Q6_K (``llama_tensor_get_type``): the head (``output.weight``), and in the
  layers llama.cpp's ``use_more_bits`` picks (the first and last eighth, every third between) the
  down projection (``ffn_down``) and the query/key/value projection (``attn_v``: fused here
  with q and k, which take the same kernel call). The embedding table is 4-bit in groups of 32
  (Q4_K_M's ``token_embd`` is Q4_K), or, tied to the head, the head's table. Where an input
  width is no multiple of 256, two bits more (``fallback_bits``), in float16 groups
  (``Int6Groups``, ``Int8Groups``).
  ``bench/quant_quality.py --sensitivity`` measures the KL each role adds at 4 bits.
- ``fp8``: the projections in float8 e4m3 (``Fp8Linear``), the head and embedding table kept
  float, as vLLM's fp8.

The fused C++ step (``kernels/step_layers.cpp``) runs the int8, int6 and int4 projections
through the same kernels as the Python layer loop (llmq's integer ones or torch's:
``quantized_linear``); a checkpoint's other kinds (act-order permutations, parts concatenated)
keep the Python loop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Literal

import torch

from llmq.worker.runner.linear.dynamic_quantized import Fp8Linear, Int8DynamicLinear
from llmq.worker.runner.linear.quantized_linear import (
    GROUP,
    Int4Blocks,
    Int6Blocks,
    Int6Linear,
    Int8Linear,
    Int8Weight,
    QuantizedLinear,
    int8_with_min,
    quantized_linear,
)
from llmq.worker.runner.linear.quantized_weights import (
    Int4Groups,
    Int6Groups,
    Int8Groups,
    Q6KBlocks,
)
from llmq.worker.runner.loaders import mapped_pages
from llmq.worker.runner.malloc_tuning import return_freed_memory

log = logging.getLogger(__name__)

Scheme = Literal["int8", "int4", "fp8", "gguf", "checkpoint"]
SCHEMES: tuple[Scheme, ...] = ("int8", "int4", "fp8", "gguf", "checkpoint")
ROLES = ("qkv", "o", "gate_up", "down", "head", "embed")
# bits(layer index, layer count, role) -> 4, 8 or 16 (float: kept as it is; layer index -1:
# head and embedding)
BitsPlan = Callable[[int, int, str], int]  # 4, 6, 8 or 16
_DENSE = ("gate_up_proj", "down_proj")
# heads whose rows a tied embedding table reads (``rows(ids)``)
_ROW_HEADS = (Int8Linear, Int8DynamicLinear, Int6Linear)


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers Q4_K_M gives more bits (integer arithmetic)."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def int8_plan(layer: int, layers: int, role: str) -> int:
    return 8


def int4_plan(layer: int, layers: int, role: str) -> int:
    if role == "head":
        return 6
    if role in ("qkv", "down") and more_bits(layer, layers):
        return 6
    return 4


def fallback_bits(bits: int, in_features: int) -> int:
    """2 bits more for a 4- or 6-bit tensor whose input width is not a multiple of 256 (a k-quant
    super-block), as llama.cpp's ``llama_tensor_get_type`` falls back there (Q4_K to Q5_0, Q6_K
    to Q8_0; llmq has no 5-bit form: 6 bits). Gemma 3 270M's width of 640 makes its Q4_K_M file's q, k,
    v, gate and up Q5_0 and its table Q8_0: taken to 4 and 6 bits at load, it was several times
    further from the float model (docs/performance.md, "Quantized weights")."""
    if bits in (4, 6) and in_features % (GROUP * 8):
        return bits + 2
    return bits


def fp8_plan(layer: int, layers: int, role: str) -> int:
    """vLLM's fp8: the layers' projections; the head and embedding table kept float."""
    return 16 if role in ("head", "embed") else 8


PLANS: dict[Scheme, BitsPlan] = {"int8": int8_plan, "int4": int4_plan, "fp8": fp8_plan}


def only_role_plan(role: str, bits: int = 4) -> BitsPlan:
    """``role`` at ``bits``, everything else at 8 (the sensitivity sweep's plans)."""
    return lambda layer, layers, r: bits if r == role else 8


class QuantizedEmbedding(torch.nn.Module):
    """An embedding table in 8 bits (``Int8Weight``, ``Int8Groups``), 6 (``Int6Blocks``,
    ``Int6Groups`` or ``Q6KBlocks``, a GGUF's Q5_K, Q5_1 or Q6_K table: a value a byte) or 4
    (``Int4Blocks``, ``Int4Groups``: two values a byte): the looked-up rows are dequantized to
    ``dtype``."""

    def __init__(self, weight, dtype: torch.dtype, scale: torch.Tensor | None):
        super().__init__()
        self.dtype = dtype
        self.embed_scale = scale  # Gemma scales its embeddings (by sqrt(hidden))
        # A table that reads its rows as they are, or a tied head's (its rows are the table's)
        rows_as_held = (Int8Weight, Int8Groups, Int6Blocks, Int6Groups, Q6KBlocks, *_ROW_HEADS)
        self.row_reader = weight if isinstance(weight, rows_as_held) else None
        self.int4 = None
        if self.row_reader is None and isinstance(weight, (Int4Blocks, Int4Groups)):
            q = weight.q.to(torch.uint8)
            nibbles = q[:, 0::2] | (q[:, 1::2] << 4)  # [V, H / 2]
            self.int4 = dataclasses.replace(weight, q=nibbles)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.row_reader is not None:
            rows = self.row_reader.rows(ids).dequantize().to(self.dtype)
        else:
            packed = self.int4.rows(ids)
            q = torch.stack([packed.q & 15, packed.q >> 4], dim=-1).flatten(-2)
            rows = dataclasses.replace(packed, q=q).dequantize().to(self.dtype)
        if self.embed_scale is not None:
            rows = rows * self.embed_scale.to(self.dtype)
        return rows

    def nbytes(self) -> int:
        """The bytes of a 4-bit table (one read as held is counted with its weight)."""
        return 0 if self.int4 is None else _weight_bytes(self.int4)


def _plain_storages(linears) -> set[int]:
    return {lin.weight.untyped_storage().data_ptr() for lin in linears}


def _release(model: torch.nn.Module, storages: set[int]) -> None:
    """Drop the model's float weights that view ``storages`` (fused weights now quantized)."""
    for param in model.parameters():
        if param.numel() and param.untyped_storage().data_ptr() in storages:
            param.data = param.data.new_empty(0)


class _Quantizer:
    """How each of a forward's weights is quantized: by a bits plan, from the float weights;
    8 bits as float8 (``Fp8Linear``) where ``fp8``."""

    def __init__(self, plan: BitsPlan, layers: int, fp8: bool = False):
        self.plan, self.layers, self.fp8 = plan, layers, fp8

    def linear(self, index: int, role: str, plain) -> QuantizedLinear | Fp8Linear | None:
        """Layer ``index``'s (-1: the head's) projection ``role`` from its plain ``Linear``
        (None: kept float)."""
        planned = self.plan(index, self.layers, role)
        bits = fallback_bits(planned, plain.weight.shape[1])
        if bits == 16:
            return None
        if self.fp8 and bits == 8:
            return Fp8Linear.quantize(plain.weight, plain.bias)
        # A fallback's 6 or 8 bits in float16 groups: the grids of llama.cpp's own fallbacks
        # (Q5_0, Q8_0) in a float checkpoint made from its file come back.
        groups = bits != planned
        return quantized_linear(plain.weight, plain.bias, bits, groups=groups)

    def embedding(self, table: torch.Tensor) -> Int8Weight | Int8Groups | Int4Blocks | None:
        bits = fallback_bits(self.plan(-1, self.layers, "embed"), table.shape[1])
        if bits == 16:
            return None
        if bits == 4 and table.shape[1] % GROUP == 0:
            return Int4Blocks.quantize(table)
        planned = self.plan(-1, self.layers, "embed")
        with_min = (int8_with_min() or bits != planned) and not table.is_cuda
        return Int8Groups.quantize(table) if with_min else Int8Weight.quantize(table)


def make_quantizer(forward, scheme: str | BitsPlan):
    """How ``forward``'s weights are quantized (its model and shape are set; its layers may
    not be built yet)."""
    device = forward.inner.embed_tokens.weight.device
    count = forward.model.config.num_hidden_layers
    if scheme == "gguf":
        if device.type != "cpu":
            raise ValueError(f"GGUF weights are served on the CPU, not on {device}")
        from llmq.worker.runner.loaders.gguf_weights import GGUFQuantizer

        return GGUFQuantizer(forward)
    if scheme == "checkpoint":
        from llmq.worker.runner.loaders.checkpoint_weights import CheckpointQuantizer

        return CheckpointQuantizer(forward)
    if (
        scheme == "fp8"
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < (8, 9)
    ):
        raise ValueError("fp8 weights need a GPU of compute capability 8.9 or more (Ada, Hopper)")
    plan = PLANS[scheme] if isinstance(scheme, str) else scheme
    return _Quantizer(plan, count, fp8=scheme == "fp8")


def quantize_forward(forward, scheme: str | BitsPlan) -> None:
    """Replace the projections, head and embedding of ``forward`` (a ``DecoderForward`` built
    with plain, unpacked weights) by quantized ones, and free their float weights. A mixture of
    experts' MLP keeps its float experts. ``scheme``: int8, int4, a bits plan, or gguf (the
    model's GGUF file's own blocks where a kernel takes them), or checkpoint (a quantized
    checkpoint's own weights where a kernel takes them; a quantizer's None keeps a weight
    float). A worker's forward quantizes each layer as it is built instead
    (``DecoderForward(..., quantization=)``): the same steps, one layer's float copies alive."""
    if forward.layout != "plain":
        raise ValueError("quantize a forward built with plain (unpacked) weights")
    quantizer = make_quantizer(forward, scheme)
    for index, layer in enumerate(forward.layers):
        quantize_layer(quantizer, index, layer, forward.model)
    finish_quantization(forward, quantizer, scheme)


def quantize_layer(quantizer, index: int, layer, model: torch.nn.Module) -> None:
    """Layer ``index``'s projections quantized, and the model's float weights they were
    fused from freed."""
    owners = [(layer, "qkv_proj", "qkv"), (layer, "o_proj", "o")]
    if hasattr(layer.mlp, "gate_up_proj"):  # a dense MLP
        owners += [(layer.mlp, "gate_up_proj", "gate_up"), (layer.mlp, "down_proj", "down")]
    replaced = []
    for owner, attr, role in owners:
        plain = getattr(owner, attr)
        quantized = quantizer.linear(index, role, plain)
        if quantized is not None:
            replaced.append(plain)
            setattr(owner, attr, quantized)
    _release(model, _plain_storages(replaced))


def finish_quantization(forward, quantizer, scheme: str | BitsPlan) -> None:
    """The head and embedding quantized once the layers are, and the forward marked so."""
    _quantize_head_and_embedding(forward, quantizer)
    forward.layout = scheme if isinstance(scheme, str) else "int4"
    forward.packed = True  # small steps take the worker's threads, as packed weights do
    # step_layers.cpp runs int8 and int4 projections on the same kernels as the Python loop.
    forward.layers_changed()
    return_freed_memory()
    log.info("weights quantized (%s): %.0f MiB", forward.layout, quantized_bytes(forward) / 2**20)


def _quantize_head_and_embedding(forward, quantizer) -> None:
    inner, model = forward.inner, forward.model
    embedding = inner.embed_tokens
    dtype = embedding.weight.dtype
    head = model.lm_head
    tied = head.weight.data_ptr() == embedding.weight.data_ptr()
    quantized = quantizer.linear(-1, "head", forward.lm_head)
    table = embedding.weight.detach()
    # Tied to an int8 head, one table: the head's rows are the embedding's.
    one_table = tied and isinstance(quantized, _ROW_HEADS)
    weight = quantized if one_table else quantizer.embedding(table)
    if quantized is not None:
        forward.lm_head = quantized
        if not tied or weight is not None:  # tied, a float embedding still reads it
            _drop(head.weight)
    if weight is not None:  # a float head keeps its own reference to the table
        scale = getattr(embedding, "embed_scale", None)
        inner.embed_tokens = QuantizedEmbedding(weight, dtype, scale)
        _drop(embedding.weight)


def _drop(param: torch.nn.Parameter) -> None:
    """Empty ``param``, handing back the weight file's pages under it (read once to quantize)."""
    mapped_pages.release(param.data)
    param.data = param.data.new_empty(0)


def quantized_bytes(forward) -> int:
    """Bytes of the quantized weights (projections, head, embedding table)."""
    head = forward.lm_head
    total = head.nbytes() if hasattr(head, "nbytes") else 0
    for layer in forward.layers:
        mlp = layer.mlp
        for p in (layer.qkv_proj, layer.o_proj, *(getattr(mlp, a, None) for a in _DENSE)):
            total += p.nbytes() if hasattr(p, "nbytes") else 0
    table = forward.inner.embed_tokens
    if not isinstance(table, QuantizedEmbedding):  # kept float
        return total
    if table.row_reader is not None and table.row_reader is not head:
        total += _weight_bytes(table.row_reader)
    return total + table.nbytes()


def _weight_bytes(weight) -> int:
    """The bytes of a quantized weight's tensors (an ``Int8Weight``, ``Int4Blocks``, ...)."""
    return sum(getattr(weight, f.name).nbytes for f in dataclasses.fields(weight))


def quantization_of(model: torch.nn.Module) -> Scheme | None:
    """The scheme ``load_causal_lm`` recorded on the model's config (``LLMQ_QUANTIZATION``)."""
    scheme = getattr(model.config, "llmq_quantization", None)
    return scheme if scheme in SCHEMES else None
