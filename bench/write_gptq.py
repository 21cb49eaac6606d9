"""A float checkpoint rewritten as a 4-bit GPTQ one (round to nearest, symmetric, groups of 128,
AutoGPTQ's packed layout), for benchmarks that need the W4A16 checkpoints people download for a
GPU and cannot download here.

    python bench/write_gptq.py SRC_DIR DST_DIR [--group 128]

Each decoder projection (``*_proj.weight`` under ``.layers.``) becomes ``qweight`` (int32
[K / 8, N], eight 4-bit rows a word, the first in the lowest bits), ``qzeros`` (int32
[K / group, N / 8], the zero point 8 stored as 7: the format's first version), ``scales``
(float16 [K / group, N]) and ``g_idx``, as AutoGPTQ's ``pack`` writes them; the scale of a
group is its largest magnitude over 7.5 (AutoGPTQ's symmetric range); the embedding, head and
norms stay as they are.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BITS = 4


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] in 0..15 -> int32 [R / 8, C]: eight consecutive rows a word, the first lowest."""
    v = values.to(torch.int64).view(values.shape[0] // 8, 8, values.shape[1])
    words = sum(v[:, j] << (BITS * j) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def gptq_tensors(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """One projection's weight [N, K] as GPTQ's tensors (symmetric, zero point 8)."""
    n, k = weight.shape
    w = weight.float().t().reshape(k // group, group, n)  # [groups, group, N]
    scale = (w.abs().amax(dim=1) * 2 / 15).clamp(min=1e-8).half()  # [groups, N]
    q = (torch.round(w / scale.float()[:, None]) + 8).clamp(0, 15).reshape(k, n)
    stored = torch.full((k // group, n), 7)  # the first version stores zero - 1
    return {
        "qweight": pack_rows(q),
        "qzeros": pack_rows(stored.t().contiguous()).t().contiguous(),  # eight columns a word
        "scales": scale,
        "g_idx": (torch.arange(k) // group).to(torch.int32),
    }


def source_state(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """``src``'s tensors, its other files (tokenizer, generation config) copied into ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.startswith("model") and path.suffix != ".safetensors":
            shutil.copy(path, dst / path.name)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def save_checkpoint(src: Path, dst: Path, tensors: dict, quantization_config: dict) -> Path:
    """``tensors`` and ``src``'s config with ``quantization_config`` written into ``dst``."""
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def write_gptq(src: Path, dst: Path, group: int = 128, device: str = "cpu") -> Path:
    """``src``'s weights as a GPTQ checkpoint in ``dst`` (computed on ``device``)."""
    state = source_state(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".layers." in name and name.endswith("_proj.weight") and tensor.shape[1] % group == 0:
            prefix = name.removesuffix(".weight")
            for part, value in gptq_tensors(tensor.to(device), group).items():
                out[f"{prefix}.{part}"] = value.cpu()
        else:
            out[name] = tensor
    quantization_config = {
        "quant_method": "gptq",
        "bits": BITS,
        "group_size": group,
        "desc_act": False,
        "sym": True,
        "checkpoint_format": "gptq",
    }
    return save_checkpoint(src, dst, out, quantization_config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args()
    print(write_gptq(args.src, args.dst, args.group))


if __name__ == "__main__":
    main()
