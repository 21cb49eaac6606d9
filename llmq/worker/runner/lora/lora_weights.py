"""A PEFT LoRA checkpoint read for llmq's forward, unmerged: per layer and projection
(``q_proj`` ... ``down_proj``) its A [rank, in] and B [out, rank]; the delta
``(x @ A.T) @ B.T * scale`` is added to that projection's part of the fused projection's output
(``lora_slots`` stacks them).

Only what this arithmetic reproduces exactly is read: plain LoRA on the seven projections of a
Llama-style layer, ``lora_alpha / r`` scaling (``alpha / sqrt(r)`` with rsLoRA). Anything else
(DoRA, trained biases, modules saved whole, per-module ranks or alphas, embedding or head
targets, a rank over the bound, shapes the base does not have) is refused with a
:class:`LoraLoadError` naming it; nothing is kept of a refused adapter.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmq.common.lora_adapters import UNSUPPORTED_OPTIONS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Fused projection -> its parts, in the order their outputs are stacked.
PARTS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
FUSED_OF = {part: fused for fused, parts in PARTS.items() for part in parts}
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight"
)


class LoraLoadError(ValueError):
    """An adapter llmq cannot serve: the message says why."""


@dataclass(frozen=True, slots=True)
class BaseShape:
    """What an adapter must fit: the layers, each part's (out, in) widths, the parts the
    base model has."""

    num_layers: int
    widths: dict[str, tuple[int, int]]  # part -> (out_features, in_features)
    parts: frozenset[str]


@dataclass(slots=True)
class Delta:
    """One projection's delta: ``(x @ a.T) @ b.T * scale`` added to its output."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]


@dataclass(slots=True)
class AdapterWeights:
    rank: int
    scale: float
    # Per layer: projection (q_proj ...) -> delta; emptied once written into its slot.
    layers: list[dict[str, Delta]] = field(default_factory=list)
    slot: int = -1  # where the pool placed it

    def nbytes(self) -> int:
        return sum(d.a.nbytes + d.b.nbytes for layer in self.layers for d in layer.values())


def read_config(folder: Path, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scale from its config; refuses what llmq cannot apply."""
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoraLoadError(f"{folder} has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise LoraLoadError(f"{folder / CONFIG_FILE} is unreadable: {exc}") from None
    if config.get("peft_type") != "LORA":
        raise LoraLoadError(f"not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    for key in UNSUPPORTED_OPTIONS:
        if config.get(key):
            raise LoraLoadError(f"unsupported LoRA feature: {key}={config[key]!r}")
    if config.get("bias", "none") != "none":
        raise LoraLoadError(f"unsupported LoRA feature: bias={config['bias']!r} (only 'none')")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise LoraLoadError(f"bad r or lora_alpha in {CONFIG_FILE}: {rank!r}, {alpha!r}")
    if rank > max_rank:
        raise LoraLoadError(f"rank {rank} is over this server's max_lora_rank {max_rank}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scale


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise LoraLoadError(f"{folder} has no {WEIGHTS_FILE}")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoraLoadError(f"{path} is unreadable: {exc}") from None


def _parts(
    tensors: dict[str, torch.Tensor], base: BaseShape, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, part) -> (A, B), every tensor checked against the base and the rank."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise LoraLoadError(f"unsupported tensor in the adapter: {key}")
        layer, group, part, which = int(match[1]), match[2], match[3], match[4]
        if part not in base.parts or (group == "mlp") != (FUSED_OF[part] in ("gate_up", "down")):
            raise LoraLoadError(f"the adapter targets {group}.{part}, which the base lacks")
        if layer >= base.num_layers:
            raise LoraLoadError(
                f"the adapter targets layer {layer}; the base has {base.num_layers}"
            )
        found.setdefault((layer, part), {})[which] = tensor
    out = {}
    for (layer, part), pair in found.items():
        if set(pair) != {"A", "B"}:
            raise LoraLoadError(f"layer {layer} {part}: lora_A and lora_B must come together")
        a, b = pair["A"], pair["B"]
        n, k = base.widths[part]
        if tuple(a.shape) != (rank, k) or tuple(b.shape) != (n, rank):
            raise LoraLoadError(
                f"layer {layer} {part}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"do not fit rank {rank} and the base's ({n}, {k}) projection"
            )
        out[layer, part] = a, b
    if not out:
        raise LoraLoadError("the adapter holds no LoRA weights")
    return out


def load_adapter(
    folder: str | Path, base: BaseShape, max_rank: int, dtype: torch.dtype, device
) -> AdapterWeights:
    """Read a PEFT LoRA folder for ``base``; raises :class:`LoraLoadError` for what llmq
    cannot apply exactly."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LoraLoadError(f"no adapter folder at {folder}")
    rank, scale = read_config(folder, max_rank)
    parts = _parts(_read_tensors(folder), base, rank)
    adapter = AdapterWeights(rank, scale, [{} for _ in range(base.num_layers)])
    for (layer, part), (a, b) in parts.items():
        adapter.layers[layer][part] = Delta(a.to(device, dtype), b.to(device, dtype))
    return adapter
