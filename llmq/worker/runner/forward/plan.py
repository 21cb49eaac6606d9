"""The forward's plan: how every step of a runner runs, decided once when the runner is built
from the settings and the model, logged in one line, shown in the worker's heartbeat and by
`llmq inspect`. A step asks the plan; it decides nothing about its shape itself, except what
depends on the step's own batch (the fused step needs every decode on the attention kernel and
no window that hides keys outside its KV group)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ForwardPlan:
    forward: str  # "llmq": llmq's decoder loop (forward/decoder_forward.py); "transformers"
    weights: str  # the loop's weight layout: plain, packed, panels, int8, int4, ...
    layer_ops: str  # "cpp": llmq's C++ ops for small steps (kernels/small_step_ops.cpp); "torch"
    fused_step: bool  # every layer in one C++ call (kernels/step_layers.cpp) where a step allows
    decode_attention: str  # "cpp": the paged decode kernel; "torch": gather and batched matmuls
    cuda_graphs: bool  # decode-only steps replayed from captured CUDA graphs

    def describe(self) -> str:
        """One line: ``llmq forward, weights panels, C++ layer ops, fused C++ step, decode
        attention by C++ kernel, no CUDA graphs``."""
        if self.forward == "transformers":
            head = "transformers' forward"
        else:
            ops = "C++" if self.layer_ops == "cpp" else "torch"
            fused = "fused C++ step" if self.fused_step else "no fused step"
            head = f"llmq forward, weights {self.weights}, {ops} layer ops, {fused}"
        attention = "C++ kernel" if self.decode_attention == "cpp" else "torch"
        graphs = "CUDA graphs" if self.cuda_graphs else "no CUDA graphs"
        return f"{head}, decode attention by {attention}, {graphs}"
