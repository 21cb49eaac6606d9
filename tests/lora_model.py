"""LoRA adapters for the tests: PEFT's own ``LoraConfig`` on a tiny local model, with lora_B
filled (PEFT starts it at zero, which would leave the output unchanged), saved as PEFT saves
them."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path | torch.nn.Module,
    out_dir: Path,
    rank: int = 8,
    seed: int = 0,
    targets: list[str] | None = None,
    **config,
) -> Path:
    """A random-weights PEFT adapter of ``base_dir``'s model (or of a loaded model, left as it
    is) saved to ``out_dir``; ``config``: more LoraConfig fields (lora_alpha, use_rslora,
    use_dora, ...)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if isinstance(base_dir, torch.nn.Module):
        base = copy.deepcopy(base_dir)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=rank,
        lora_alpha=config.pop("lora_alpha", 2 * rank),
        target_modules=targets or ALL_TARGETS,
        lora_dropout=0.0,
        init_lora_weights=False,  # random A and B: the adapter changes the output
        **config,
    )
    model = get_peft_model(base, lora)
    randomize_lora(model, torch.Generator().manual_seed(seed), std=0.2)
    model.save_pretrained(out_dir)
    return out_dir


def randomize_lora(model: torch.nn.Module, gen: torch.Generator, std: float) -> None:
    """Every LoRA A and B of a PEFT model drawn anew from N(0, std^2)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
