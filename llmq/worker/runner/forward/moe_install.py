"""llmq's MoE layers (``moe.py``) in place of a model's own MoE blocks, inside transformers'
forward: the models whose layers llmq's fast forward does not walk still route and run their
experts the grouped way, with packed weights."""

from __future__ import annotations

import logging

import torch

from llmq.worker.runner.forward.moe import MoeMLP, from_block, is_moe_block, moe_layout
from llmq.worker.runner.linear.packed_linear import choose_panel_sums

log = logging.getLogger(__name__)


class MoeBlock(torch.nn.Module):
    """Stands where the model's MoE block stood: ``[batch, seq, hidden]`` in and out (gpt-oss's
    decoder layer also unpacks a second value, its router scores, which it never reads)."""

    def __init__(self, moe: MoeMLP, returns_pair: bool):
        super().__init__()
        self.moe = moe
        self.returns_pair = returns_pair

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        out = self.moe(hidden_states.reshape(-1, shape[-1])).view(shape)
        return (out, None) if self.returns_pair else out


def install_moe(model: torch.nn.Module, pack: bool = False, kernels: bool = False) -> int:
    """Replace every MoE block of ``model`` that llmq implements; returns how many."""
    replaced = []
    layout = None
    for name, module in list(model.named_modules()):
        if not is_moe_block(module):
            continue
        if layout is None:  # probed once
            layout = moe_layout(module, pack, kernels)
            if layout == "panels":
                choose_panel_sums()
        moe = from_block(module, layout)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        returns_pair = type(module).__name__ == "GptOssMLP"
        setattr(parent, attr, MoeBlock(moe, returns_pair))
        replaced.append(moe)
    if replaced:
        log.info(
            "mixture of experts: llmq's grouped experts in %d layers, weights %s",
            len(replaced),
            replaced[0].layout,
        )
    return len(replaced)
