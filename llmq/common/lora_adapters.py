"""LoRA adapters as the API and the registry know them: a name clients give as ``model``, the
base model it applies to, the PEFT folder it is read from, and the tenant that loaded it.

``check_adapter`` reads the folder without torch (``adapter_config.json`` and the
safetensors header, never the tensors) and refuses what a worker could not apply, so that a
bad adapter is a 400 when it is loaded, not a failure of every request that names it. The
worker reads the tensors themselves (``worker/runner``) and checks again."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

# The projections an adapter may target, as PEFT names them on Llama-style layers.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight
_TENSOR = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_MAX_HEADER = 100 * 1024 * 1024  # a safetensors header past this is not one


# PEFT options that change what an adapter computes or where; refused when set (by the API
# when an adapter is loaded, and by the worker when it reads one).
UNSUPPORTED_OPTIONS = (
    "use_dora",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "fan_in_fan_out",
    "lora_bias",
    "use_qalora",
    "layer_replication",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "target_parameters",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "monteclora_config",
    "megatron_config",
)


class AdapterError(ValueError):
    """An adapter that cannot be served, with the reason a client reads."""


@dataclass(slots=True)
class AdapterRecord:
    """One adapter in the registry (``Keys.loras``). ``owner``: the tenant that loaded it
    (its requests and listings alone see it); "" for one configured at start (everyone's)."""

    name: str
    base: str
    path: str
    owner: str = ""
    rank: int = 0
    created: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> AdapterRecord:
        data = json.loads(raw)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def visible_to(self, owner: str) -> bool:
        return not self.owner or self.owner == owner


def parse_lora_modules(text: str) -> list[tuple[str, str]]:
    """``name=path,name=path`` (LLMQ_LORA_MODULES) as (name, path) pairs."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise AdapterError(f"LLMQ_LORA_MODULES: {item!r} is not name=path")
        pairs.append((name.strip(), path.strip()))
    return pairs


@dataclass(slots=True)
class AdapterInfo:
    rank: int
    targets: tuple[str, ...]


def check_adapter(path: str, base: dict | None, max_rank: int) -> AdapterInfo:
    """The adapter at ``path`` if a worker can apply it to a model of config ``base`` (its
    ``config.json`` as a dict; None: the shapes are not checked), else AdapterError."""
    folder = Path(path)
    config = _read_config(folder)
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter {path}: r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter {path}: rank {rank} exceeds LLMQ_MAX_LORA_RANK={max_rank}")
    _refuse_unsupported(config, path)
    shapes = _read_header(folder / "adapter_model.safetensors")
    targets = _check_tensors(shapes, rank, base, path)
    return AdapterInfo(rank=rank, targets=targets)


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise AdapterError(f"{folder}: no adapter_config.json (not a PEFT adapter)") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{folder}/adapter_config.json unreadable: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{folder}/adapter_config.json is not an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder}: peft_type {config.get('peft_type')!r} is not LORA")
    return config


def _refuse_unsupported(config: dict, path: str) -> None:
    """PEFT options that change the arithmetic beyond x @ A^T @ B^T * scale."""
    if config.get("use_dora"):
        raise AdapterError(f"adapter {path}: DoRA (use_dora) is not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"adapter {path}: modules_to_save is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapter {path}: bias={config['bias']!r} is not supported")
    for key in UNSUPPORTED_OPTIONS:
        if config.get(key):
            raise AdapterError(f"adapter {path}: {key} is not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        raise AdapterError(f"adapter {path}: a regex target_modules is not supported")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise AdapterError(
            f"adapter {path}: targets {unknown} are not among the projections adapters apply "
            f"to ({', '.join(TARGETS)})"
        )


def _read_header(file: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the safetensors header alone."""
    try:
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise ValueError("header too large")
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise AdapterError(f"{file.parent}: no adapter_model.safetensors") from None
    except (OSError, ValueError, struct.error) as exc:
        raise AdapterError(f"{file} is not a safetensors file: {exc}") from None
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def _expected_widths(base: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection of a model of config ``base``."""
    hidden = base["hidden_size"]
    heads = base["num_attention_heads"]
    head_dim = base.get("head_dim") or hidden // heads
    kv = base.get("num_key_value_heads") or heads
    inter = base["intermediate_size"]
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def _check_tensors(
    shapes: dict[str, list[int]], rank: int, base: dict | None, path: str
) -> tuple[str, ...]:
    found: dict[tuple[int, str], dict[str, list[int]]] = {}
    for name, shape in shapes.items():
        m = _TENSOR.match(name)
        if m is None:
            raise AdapterError(f"adapter {path}: tensor {name} is not a LoRA A/B weight")
        layer, target, part = int(m.group(1)), m.group(2), m.group(3)
        if target not in TARGETS:
            raise AdapterError(f"adapter {path}: tensor {name} targets {target}")
        found.setdefault((layer, target), {})[part] = shape
    if not found:
        raise AdapterError(f"adapter {path}: no LoRA weights")
    widths = _expected_widths(base) if base and "intermediate_size" in base else None
    layers = base.get("num_hidden_layers") if base else None
    for (layer, target), parts in found.items():
        if set(parts) != {"A", "B"}:
            raise AdapterError(f"adapter {path}: layer {layer} {target} lacks lora_A or lora_B")
        if layers is not None and layer >= layers:
            raise AdapterError(f"adapter {path}: layer {layer}; the base model has {layers}")
        a, b = parts["A"], parts["B"]
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise AdapterError(f"adapter {path}: layer {layer} {target}: shapes {a}, {b}")
        if widths is not None and (a[1], b[0]) != widths[target]:
            raise AdapterError(
                f"adapter {path}: layer {layer} {target} is {a[1]} -> {b[0]}; the base "
                f"model's is {widths[target][0]} -> {widths[target][1]}"
            )
    return tuple(t for t in TARGETS if any(k[1] == t for k in found))
