"""M-RoPE in llmq's forward (Qwen2.5-VL's text model): rows whose three positions are one take
plain RoPE at it, computed on one component, bit-equal to the model's rotary module on three;
rows whose three differ take the module's per-section cos and sin."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2_5_VLTextConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

from llmq.worker.runner.forward.decoder_forward import one_position_mrope

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def rotary():
    config = Qwen2_5_VLTextConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    return Qwen2_5_VLRotaryEmbedding(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_position_equals_the_module_on_three(rotary, dtype):
    h = torch.zeros(1, 1, 64, dtype=dtype)
    positions = torch.tensor([0, 1, 7, 300, 4095, 131071])
    cos, sin = one_position_mrope(rotary, h, positions)
    for ids in (positions[None], positions.expand(3, 1, -1)):
        want_cos, want_sin = rotary(h, ids)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_rows_of_three_positions_differ_from_one(rotary):
    """An image row (its height and width components apart): not plain RoPE at any one."""
    h = torch.zeros(1, 1, 64)
    image = torch.tensor([[5, 5], [5, 7], [5, 9]])[:, None, :]
    cos, _ = rotary(h, image)
    for one in (5, 7, 9):
        plain, _ = one_position_mrope(rotary, h, torch.tensor([one, one]))
        assert not torch.equal(cos[0, 1], plain[0, 1])
