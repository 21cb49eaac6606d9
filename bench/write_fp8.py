"""A float checkpoint rewritten as an FP8 one, in either layout people download for a GPU and
cannot download here:

- ``blocks``: transformers' ``quant_method: fp8`` as DeepSeek-V3's and Qwen3's FP8 releases hold
  it: ``weight`` float8 e4m3 and ``weight_scale_inv`` float32, one scale per 128 x 128 block
  (its largest magnitude over 448);
- ``channel``: compressed-tensors ``float-quantized`` as llm-compressor's FP8-dynamic writes it:
  ``weight`` float8 e4m3 and ``weight_scale`` [N, 1], one scale per output channel.

    python bench/write_fp8.py SRC_DIR DST_DIR [--layout blocks|channel]

Each decoder projection (``*_proj.weight`` under ``.layers.``) is quantized; the embedding,
head and norms stay as they are.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.write_gptq import save_checkpoint, source_state  # noqa: E402

FP8 = torch.float8_e4m3fn
TOP = 448.0
BLOCK = 128


def block_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """[N, K] -> fp8 weight and a scale per 128 x 128 block (partial blocks at the ends)."""
    n, k = weight.shape
    padded = F.pad(weight.float(), (0, -k % BLOCK, 0, -n % BLOCK))
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / TOP).clamp(min=1e-12)  # [N / 128, K / 128]
    q = (blocks / scale[:, None, :, None]).clamp(-TOP, TOP).view(padded.shape)[:n, :k]
    return {"weight": q.to(FP8).contiguous(), "weight_scale_inv": scale.contiguous()}


def channel_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """[N, K] -> fp8 weight and a scale per output channel [N, 1]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / TOP).clamp(min=1e-12)
    return {"weight": (w / scale).clamp(-TOP, TOP).to(FP8), "weight_scale": scale}


def _config(layout: str) -> dict:
    if layout == "blocks":
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": ["lm_head"],
        }
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**fp8, "strategy": "channel"},
                "input_activations": {**fp8, "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }


def write_fp8(src: Path, dst: Path, layout: str = "blocks", device: str = "cpu") -> Path:
    """``src``'s weights as an FP8 checkpoint of ``layout`` in ``dst`` (computed on
    ``device``)."""
    state = source_state(src, dst)
    quantize = block_tensors if layout == "blocks" else channel_tensors
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            prefix = name.removesuffix(".weight")
            for part, value in quantize(tensor.to(device)).items():
                out[f"{prefix}.{part}"] = value.cpu()
        else:
            out[name] = tensor
    return save_checkpoint(src, dst, out, _config(layout))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--layout", choices=("blocks", "channel"), default="blocks")
    args = ap.parse_args()
    print(write_fp8(args.src, args.dst, args.layout))


if __name__ == "__main__":
    main()
