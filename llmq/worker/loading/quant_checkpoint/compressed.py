"""compressed-tensors checkpoints (``quant_method: compressed-tensors``: llm-compressor's).

Integer weights in two of its formats, as its compressors write them:

- ``pack-quantized`` (W4A16 and the like): ``weight_packed`` int32 [N, K * bits / 32], the
  input dimension packed densely, the lowest bits first, each value stored offset by
  ``2**(bits - 1)`` (unsigned); ``weight_scale`` [N, G] (``group``: G = K / group_size;
  ``channel``: G = 1); ``weight_shape`` [N, K]; asymmetric schemes add ``weight_zero_point``,
  packed the same way along the output dimension ([N * bits / 32, G]; unpacked int8 [N, G] in
  older files). ``weight = (q - zero) * scale`` with q and zero signed.
- ``int-quantized`` / ``naive-quantized`` (W8A8 int8): ``weight`` int8 [N, K] and
  ``weight_scale`` [N, 1] (``channel``) or [1] (``tensor``). The activations of a W8A8
  checkpoint are served unquantized (bfloat16 into the int8 kernel, or the model's dtype): W8A16.
- ``float-quantized`` (FP8 W8A8, "FP8-dynamic"): ``weight`` float8 e4m3 [N, K] and
  ``weight_scale`` [N, 1] (``channel``), [1] (``tensor``), [N, K / group] (``group``) or
  [ceil(N / bn), ceil(K / bk)] (``block``, ``block_structure: [bn, bk]``): ``Fp8Tensor``. A
  static ``input_scale`` is dropped: activations are quantized per row as each call runs.

``weight_g_idx`` (older files' group activation order) gives each input column's group.
Other float formats (nvfp4, mxfp4, ...), sparse formats and transforms are refused.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

import torch

from llmq.worker.loading.quant_checkpoint.fp8_tensor import WHOLE, Fp8Tensor, fp8_tensor
from llmq.worker.loading.quant_checkpoint.quant_tensor import QuantTensor, unpack_int32

log = logging.getLogger(__name__)

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
STRATEGIES = ("channel", "group", "tensor")
FLOAT_STRATEGIES = (*STRATEGIES, "block")


def _check_args(weights: dict, where: str) -> None:
    kind, bits = weights.get("type", "int"), int(weights.get("num_bits", 8))
    strategy = weights.get("strategy", "tensor")
    if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
        raise ValueError(
            f"compressed-tensors {kind} {bits}-bit weights ({where}) are not implemented"
        )
    if strategy not in (FLOAT_STRATEGIES if kind == "float" else STRATEGIES):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not implemented")


def _block(weights: dict) -> tuple[int, int]:
    """The block of an fp8 weight each scale covers (``Fp8Tensor``)."""
    strategy = weights.get("strategy", "tensor")
    if strategy == "block":
        rows, cols = weights.get("block_structure") or (128, 128)
        return int(rows), int(cols)
    if strategy == "group":
        return 1, int(weights["group_size"])
    return (1, WHOLE) if strategy == "channel" else (WHOLE, WHOLE)


def _per_row(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A scale or zero point as [rows, G]: one per tensor repeated on every row."""
    return t.reshape(rows, -1) if t.numel() >= rows else t.reshape(1, 1).expand(rows, 1)


class CompressedFormat:
    name = "compressed-tensors"
    marker = "weight_scale"
    parts = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
    # Tensors of activation quantization, which is not served: dropped at load.
    dropped = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")

    def __init__(self, config: dict):
        top = config.get("format") or "dense"
        status = config.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(
                f"compressed-tensors quantization_status {status!r} is not implemented"
            )
        for refused in ("transform_config", "kv_cache_scheme"):
            if config.get(refused):
                raise ValueError(f"compressed-tensors {refused} is not implemented")
        sparsity = (config.get("sparsity_config") or {}).get("format", "dense")
        if sparsity != "dense":
            raise ValueError(f"compressed-tensors sparsity format {sparsity!r} is not implemented")
        self.groups = []  # (targets, weights args)
        activations = False
        for name, group in (config.get("config_groups") or {}).items():
            fmt = group.get("format") or top
            if fmt not in FORMATS:
                raise ValueError(f"compressed-tensors format {fmt!r} is not implemented")
            weights = group.get("weights") or {}
            _check_args(weights, name)
            activations |= bool(group.get("input_activations"))
            self.groups.append((group.get("targets") or ["Linear"], weights))
        if not self.groups:
            raise ValueError("compressed-tensors config without config_groups")
        served = (
            "fp8 activations per row, as each call runs"
            if top == "float-quantized"
            else ("activations served unquantized: W8A16 / W4A16")
        )
        self.description = f"compressed-tensors {top}" + (f" ({served})" if activations else "")

    def weights(self, module: str) -> dict:
        """The weights arguments of ``module``'s scheme: its config group by target (a regular
        expression ``re:...`` on the module's name, else a class name matched by any Linear)."""
        fallback = None
        for targets, weights in self.groups:
            for target in targets:
                if target.startswith("re:") and re.match(target[3:], module):
                    return weights
                if fallback is None and not target.startswith("re:"):
                    fallback = weights
        if fallback is None:
            raise ValueError(f"no compressed-tensors config group names {module}")
        return fallback

    def decode(
        self, get: Callable[[str], torch.Tensor], module: str = ""
    ) -> QuantTensor | Fp8Tensor:
        weights = self.weights(module)
        bits = int(weights.get("num_bits", 8))
        if weights.get("type") == "float":
            return fp8_tensor(get("weight"), get("weight_scale"), _block(weights))
        offset = 2 ** (bits - 1)
        packed = get("weight_packed")
        if packed is not None:
            n, k = (int(v) for v in get("weight_shape"))
            q = unpack_int32(packed, bits, k)  # stored offset: unsigned already
        else:
            q = get("weight").to(torch.int32) + offset
            n, k = q.shape
        scale = _per_row(get("weight_scale").float(), n)
        stored = get("weight_zero_point")
        if stored is None:
            zero = torch.full(scale.shape, offset, dtype=torch.int32)
        elif stored.dtype == torch.int32 and packed is not None:  # packed, output dimension
            zero = unpack_int32(stored.t(), bits, n).t()
        else:
            zero = _per_row(stored.to(torch.int32), n) + offset
        g_idx = get("weight_g_idx")
        return QuantTensor(
            q=q,
            scale=scale.contiguous(),
            zero=zero.contiguous(),
            bits=bits,
            g_idx=None if g_idx is None or bool((g_idx < 0).all()) else g_idx.long(),
        )
