"""Mixture-of-experts layers in llmq's own code: Qwen3-MoE, Mixtral and gpt-oss.

transformers runs a MoE block as a router module, then an experts module that either loops over
the experts in Python (``eager``) or sorts the token-expert pairs and calls ``grouped_mm`` over
all experts' stacked weights (its default). This does what a real MoE kernel does, with weights
laid out once for llmq's projections (``packed_linear.Linear``: packed for oneDNN or for llmq's
own matmul in bfloat16 on CPU, the row-major weight otherwise):

1. route: the router's logits, then each model's own top-k (softmax over all experts, top k,
   optionally renormalised: Qwen3-MoE's ``norm_topk_prob``, always for Mixtral; or gpt-oss's top
   k of the biased logits, then a softmax over those k);
2. group: sort the step's token-expert pairs by expert (stable), gather the tokens once;
3. run every expert that has tokens on its own rows only: one gate-and-up matmul, the
   activation (SiLU-and-multiply, or gpt-oss's clamped SwiGLU with ``alpha``, ``limit`` and its
   biases), one down matmul, scaled by the routing weight;
4. combine: each token's k results summed in rank order, as transformers' grouped path sums
   them (``view(tokens, k, hidden).sum(1)``), so float32 output carries its bits.

``MoeMLP`` is a callable ``[tokens, hidden] -> [tokens, hidden]``: the MLP of a layer of llmq's
fast forward, or wrapped by ``moe_install`` as a replacement of the model's own block inside
transformers' forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from llmq.worker.runner.linear.packed_linear import Layout, Linear, can_pack, panels_fit

# softmax_topk: softmax over all experts (float32), top k, optional renormalisation
# (Qwen3-MoE, Mixtral); topk_softmax: top k of the logits, softmax over those (gpt-oss).
RoutingMode = Literal["softmax_topk", "topk_softmax"]


@dataclass(slots=True)
class Router:
    weight: torch.Tensor  # [experts, hidden]
    bias: torch.Tensor | None  # [experts] (gpt-oss)
    top_k: int
    mode: RoutingMode
    renormalize: bool  # the top-k probabilities divided by their sum
    # Whether the routing weights are cast back to the logits' dtype (Qwen3-MoE) or stay
    # float32 (Mixtral: its experts' outputs are then scaled in float32).
    cast_weights: bool

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token, its experts [T, k] and their weights [T, k]."""
        logits = F.linear(x, self.weight, self.bias)
        if self.mode == "topk_softmax":
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return experts, torch.softmax(top, dim=1, dtype=top.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top /= top.sum(dim=-1, keepdim=True)
        if self.cast_weights:
            top = top.to(logits.dtype)
        return experts, top


@dataclass(slots=True)
class SwiGLU:
    """gpt-oss's gate: ``(clamp(up) + 1) * g * sigmoid(alpha * g)``, g the gate clamped above."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def silu_and_mul(act_fn: Callable[[torch.Tensor], torch.Tensor]):
    """The gated activation of Qwen3-MoE and Mixtral experts: ``act(gate) * up``."""

    def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return act_fn(gate) * up

    return gated


@dataclass(slots=True)
class Expert:
    gate_up: Linear  # gate rows first, then up rows
    down: Linear
    gate_up_bias: torch.Tensor | None  # added after the matmul, as the model adds it
    down_bias: torch.Tensor | None


class MoeMLP:
    """``__call__(x [T, hidden]) -> [T, hidden]``: route, group by expert, run, combine."""

    def __init__(
        self,
        router: Router,
        experts: list[Expert],
        intermediate: int,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        layout: Layout,
    ):
        self.router = router
        self.experts = experts
        self.intermediate = intermediate
        self.activation = activation
        self.layout = layout

    def __call__(self, x: torch.Tensor, cpp_ops: bool = False) -> torch.Tensor:
        """``cpp_ops``: the fast forward's flag for its small-step C++ ops (not used here)."""
        tokens, hidden = x.shape
        k = self.router.top_k
        expert_ids, weights = self.router(x)
        if tokens == 1:  # a lone decode: its k experts, nothing to group
            return self._one_token(x, expert_ids[0].tolist(), weights)
        pairs = expert_ids.reshape(-1)  # [T * k], pair p is token p // k's rank p % k
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        pair_weights = weights.reshape(-1)[order]
        rows = x[order // k]  # the tokens, grouped by expert
        out_dtype = torch.result_type(x, pair_weights)
        combined = torch.empty(tokens * k, hidden, dtype=out_dtype, device=x.device)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if not count:
                continue
            end = start + count
            y = self._expert(expert, rows[start:end])
            # Scattered back to the pairs' own places: token-major, rank-minor.
            combined[order[start:end]] = y * pair_weights[start:end, None]
            start = end
        return combined.view(tokens, k, hidden).sum(dim=1).to(x.dtype)

    def _one_token(self, x: torch.Tensor, experts: list[int], weights: torch.Tensor):
        """``__call__`` for one token: the same rows, products and sum, without the sort."""
        combined = None
        for rank, expert in enumerate(experts):
            y = self._expert(self.experts[expert], x) * weights[:, rank, None]
            if combined is None:
                combined = y.new_empty(len(experts), *y.shape)
            combined[rank] = y
        return combined.transpose(0, 1).sum(dim=1).to(x.dtype)

    def storages(self) -> set[int]:
        """The storages of the experts' weights held row-major (views of the model's own
        parameters, which must not be copied elsewhere: ``decoder_layers.own_memory``)."""
        if self.layout != "plain":
            return set()
        return {
            linear.weight.untyped_storage().data_ptr()
            for expert in self.experts
            for linear in (expert.gate_up, expert.down)
        }

    def _expert(self, expert: Expert, x: torch.Tensor) -> torch.Tensor:
        gate_up = expert.gate_up(x)
        if expert.gate_up_bias is not None:
            gate_up = gate_up + expert.gate_up_bias
        inter = self.intermediate
        y = expert.down(self.activation(gate_up[:, :inter], gate_up[:, inter:]))
        if expert.down_bias is not None:
            y = y + expert.down_bias
        return y


def choose_layout(gate_up: torch.Tensor, down: torch.Tensor, pack: bool, kernels: bool) -> Layout:
    """How an expert's weights (``gate_up`` [2I, hidden], ``down`` [hidden, I]) are laid out:
    llmq's panels where its kernels serve both widths, oneDNN's blocks where they give
    F.linear's bits, else row-major."""
    if pack and kernels and panels_fit(gate_up) and panels_fit(down):
        return "panels"
    return "onednn" if pack and can_pack(down) else "plain"


def _linear(weight: torch.Tensor, layout: Layout) -> Linear:
    return Linear(weight if layout == "plain" else weight.contiguous(), None, layout)


def _experts_of(
    gate_up: torch.Tensor,  # [E, 2I, hidden], gate rows then up rows
    down: torch.Tensor,  # [E, hidden, I]
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    layout: Layout,
) -> list[Expert]:
    return [
        Expert(
            gate_up=_linear(gate_up[e], layout),
            down=_linear(down[e], layout),
            gate_up_bias=gate_up_bias[e] if gate_up_bias is not None else None,
            down_bias=down_bias[e] if down_bias is not None else None,
        )
        for e in range(gate_up.shape[0])
    ]


def _release(module: torch.nn.Module) -> None:
    """Drop the model's own copies of weights now held (packed or rearranged) elsewhere."""
    for param in module.parameters():
        param.data = param.data.new_empty(0)


MOE_BLOCKS = frozenset({"Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock", "GptOssMLP"})


def is_moe_block(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a MoE block this module implements."""
    return type(module).__name__ in MOE_BLOCKS


def moe_layout(block: torch.nn.Module, pack: bool, kernels: bool) -> Layout:
    """``choose_layout`` for the experts of ``block`` (a MoE block)."""
    experts = block.experts
    gate_up, down = experts.gate_up_proj[0], experts.down_proj[0]
    if type(block).__name__ == "GptOssMLP":  # stored transposed
        gate_up, down = gate_up.t(), down.t()
    return choose_layout(gate_up, down, pack, kernels)


def from_block(block: torch.nn.Module, layout: Layout = "plain") -> MoeMLP | None:
    """llmq's MoE layer for a model's own MoE block (Qwen3-MoE's, Mixtral's or gpt-oss's), its
    experts' weights in ``layout``; None for any other module. Packed or rearranged, the
    block's own weights are released."""
    name = type(block).__name__
    if name in ("Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock"):
        return _gated_silu(block, layout, qwen=name.startswith("Qwen3"))
    if name == "GptOssMLP":
        return _gpt_oss(block, layout)
    return None


def _gated_silu(block: torch.nn.Module, layout: Layout, qwen: bool) -> MoeMLP:
    gate, experts = block.gate, block.experts
    router = Router(
        weight=gate.weight,  # the parameter: ``own_memory`` may move its data later
        bias=None,
        top_k=gate.top_k,
        mode="softmax_topk",
        renormalize=bool(gate.norm_topk_prob) if qwen else True,
        cast_weights=qwen,
    )
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    moe = MoeMLP(
        router,
        _experts_of(gate_up, down, None, None, layout),
        experts.intermediate_dim,
        silu_and_mul(experts.act_fn),
        layout,
    )
    if layout != "plain":
        _release(experts)
    return moe


def _gpt_oss(block: torch.nn.Module, layout: Layout) -> MoeMLP:
    router_module, experts = block.router, block.experts
    router = Router(
        weight=router_module.weight,
        bias=router_module.bias,
        top_k=router_module.top_k,
        mode="topk_softmax",
        renormalize=False,
        cast_weights=False,
    )
    # Stored transposed ([E, hidden, 2I], [E, I, hidden]) with gate and up interleaved
    # (columns 0, 2, 4... the gate): rearranged once into gate columns, then up columns, and
    # viewed as [E, 2I, hidden]. Row-major, those views multiply as the model's ``x @ W`` does
    # (the same bits); packed, they are copied into their layout.
    stored = experts.gate_up_proj.detach()
    gate_up = torch.cat((stored[..., 0::2], stored[..., 1::2]), dim=-1).transpose(1, 2)
    bias = experts.gate_up_proj_bias.detach()
    bias = torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1)
    down = experts.down_proj.detach().transpose(1, 2)  # [E, hidden, I]
    moe = MoeMLP(
        router,
        _experts_of(gate_up, down, bias, experts.down_proj_bias.detach(), layout),
        experts.intermediate_size,
        SwiGLU(alpha=experts.alpha, limit=experts.limit),
        layout,
    )
    _release(experts)  # rearranged copies: the model's own are no longer read
    return moe
