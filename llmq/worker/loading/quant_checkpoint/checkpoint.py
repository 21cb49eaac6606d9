"""A quantized checkpoint's safetensors files: its projections decoded (``QuantTensor``) and
its float state dict (every quantized projection dequantized) for transformers' modules.

The format comes from config.json's ``quantization_config``: compressed-tensors, GPTQ, AWQ or
transformers' fp8; any other ``quant_method`` (bitsandbytes, hqq, ...) is refused at load,
naming it.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict

import torch

from llmq.worker.loading.quant_checkpoint.awq import AWQFormat
from llmq.worker.loading.quant_checkpoint.compressed import CompressedFormat
from llmq.worker.loading.quant_checkpoint.fp8 import Fp8Format
from llmq.worker.loading.quant_checkpoint.fp8_tensor import FP8, Fp8Tensor
from llmq.worker.loading.quant_checkpoint.gptq import GPTQFormat
from llmq.worker.loading.quant_checkpoint.quant_tensor import QuantTensor

log = logging.getLogger(__name__)

Format = GPTQFormat | AWQFormat | CompressedFormat | Fp8Format
FORMATS = {
    "gptq": GPTQFormat,
    "awq": AWQFormat,
    "compressed-tensors": CompressedFormat,
    "fp8": Fp8Format,
}


def checkpoint_format(quantization_config: dict) -> Format:
    """The reader of a checkpoint's ``quantization_config``; ValueError where llmq has none."""
    method = str(quantization_config.get("quant_method", "")).lower().replace("_", "-")
    if method not in FORMATS:
        raise ValueError(
            f"quantization {method or quantization_config!r} is not implemented "
            f"(llmq reads {', '.join(FORMATS)} checkpoints)"
        )
    return FORMATS[method](quantization_config)


class QuantCheckpoint:
    """The tensors of ``files`` (safetensors), read as they are asked for."""

    def __init__(self, files: list[str], fmt: Format):
        from safetensors import safe_open

        self.format = fmt
        self.where: dict[str, object] = {}  # tensor name -> its open file
        for path in files:
            handle = safe_open(path, framework="pt")
            self.where.update(dict.fromkeys(handle.keys(), handle))
        parts: dict[str, set[str]] = defaultdict(set)
        for key in self.where:
            module, _, part = key.rpartition(".")
            parts[module].add(part)
        self.modules = sorted(m for m, p in parts.items() if fmt.marker in p)
        self._consumed = {f"{m}.{p}" for m in self.modules for p in (*fmt.parts, "weight")}
        dropped = getattr(fmt, "dropped", ())
        self._consumed |= {k for k in self.where if k.rpartition(".")[2] in dropped}

    def tensor(self, name: str) -> torch.Tensor | None:
        handle = self.where.get(name)
        return None if handle is None else handle.get_tensor(name)

    def quant(self, module: str) -> QuantTensor | Fp8Tensor | None:
        """``module``'s weight as the checkpoint quantized it; None where it is float."""
        if module not in self.modules:
            return None
        get = lambda part: self.tensor(f"{module}.{part}")  # noqa: E731
        if isinstance(self.format, CompressedFormat):
            return self.format.decode(get, module)
        return self.format.decode(get)

    def float_state_dict(self, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], Counter]:
        """Every tensor for transformers' modules, the quantized projections dequantized to
        ``dtype``; and how many projections each of torch's kernels takes (None: float)."""
        state: dict[str, torch.Tensor] = {}
        kernels: Counter = Counter()
        layouts: Counter = Counter()
        for module in self.modules:
            weight = self.quant(module)
            state[f"{module}.weight"] = weight.dequantize().to(dtype)
            kernels[weight.kernel()] += 1
            layouts[weight.layout()] += 1
        for key in self.where:
            if key in self._consumed:
                continue
            value = self.tensor(key)
            if value.dtype == FP8:  # an fp8 tensor without the scale it is read with
                raise ValueError(f"{key}: fp8 tensor of a layout that is not implemented")
            state[key] = value.to(dtype) if value.is_floating_point() else value
        log.info(
            "%s: %d quantized projections (%s)",
            self.format.description,
            len(self.modules),
            "; ".join(f"{n} x {layout}" for layout, n in layouts.items()),
        )
        return state, kernels
