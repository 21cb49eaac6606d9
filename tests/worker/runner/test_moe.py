"""llmq's MoE layer against each model's own MoE block: the same bits in float32 on random
inputs (every family: Qwen3-MoE, Mixtral, gpt-oss), whatever the batch, and installed in
transformers' forward, the same logits."""

from __future__ import annotations

import copy

import pytest
import torch

from llmq.tools.model_archs import perturb, tiny_config
from llmq.worker.runner.forward.moe import from_block
from llmq.worker.runner.forward.moe_install import MoeBlock, install_moe

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")


def tiny_model(arch: str, experts_implementation: str | None = None, **options):
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    for name, value in options.items():
        setattr(config, name, value)
    if experts_implementation:
        config._experts_implementation = experts_implementation
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb(model)
    return model


def own_output(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = block(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out)[0]


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_moe_layer_has_the_bits_of_the_models_own_block(arch, implementation):
    model = tiny_model(arch, implementation)
    block = model.model.layers[0].mlp
    moe = from_block(copy.deepcopy(block))
    assert moe is not None
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for tokens in (1, 2, 7, 16, 64):
            x = torch.randn(tokens, model.config.hidden_size, generator=gen)
            expected = own_output(block, x)
            assert torch.equal(moe(x), expected), (arch, tokens)


def test_qwen3_moe_without_renormalised_top_k_and_with_three_active_experts():
    model = tiny_model("qwen3_moe", norm_topk_prob=False, num_experts_per_tok=3)
    block = model.model.layers[1].mlp
    moe = from_block(copy.deepcopy(block))
    x = torch.randn(33, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        # Three results a token are summed in rank order, as transformers' grouped path does.
        assert torch.equal(moe(x), own_output(block, x))
        probs = torch.softmax(torch.nn.functional.linear(x, block.gate.weight), -1)
        assert not torch.allclose(probs.topk(3).values.sum(-1), torch.ones(33))


def test_other_modules_are_left_alone():
    model = tiny_model("qwen3")
    assert from_block(model.model.layers[0].mlp) is None
    assert install_moe(model) == 0


@pytest.mark.parametrize("arch", FAMILIES)
def test_installed_in_transformers_forward_the_logits_are_the_same(arch):
    model = tiny_model(arch)
    served = copy.deepcopy(model)
    assert install_moe(served) == model.config.num_hidden_layers
    assert all(isinstance(layer.mlp, MoeBlock) for layer in served.model.layers)
    ids = torch.randint(3, model.config.vocab_size, (2, 19), generator=torch.Generator())
    with torch.inference_mode():
        assert torch.equal(served(ids).logits, model(ids).logits)


def test_the_fast_forward_takes_moe_layers_where_it_knows_the_attention():
    from llmq.worker.runner.forward.decoder_forward import build_forward
    from llmq.worker.runner.forward.moe import MoeMLP

    for arch in ("qwen3_moe", "mixtral"):  # Qwen 3's and Mistral's attention
        forward = build_forward(tiny_model(arch), fast_forward=True, pack=False)
        assert forward is not None
        assert all(isinstance(layer.mlp, MoeMLP) for layer in forward.layers)
    gpt_oss = tiny_model("gpt_oss")  # sinks: transformers' forward, llmq's MoE blocks in it
    assert build_forward(gpt_oss, fast_forward=True, pack=False) is None
    assert all(isinstance(layer.mlp, MoeBlock) for layer in gpt_oss.model.layers)


def test_the_moe_1b_shape_has_1b_parameters_a_quarter_of_them_active():
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from llmq.tools.model_factory import SHAPES

    config = Qwen3MoeConfig(**SHAPES["moe-1b"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # the tied head once
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embedding = model.model.embed_tokens.weight.numel()
    active = total - embedding - experts * (1 - config.num_experts_per_tok / config.num_experts)
    assert 0.95e9 < total < 1.1e9
    assert 0.2e9 < active < 0.3e9  # per token, besides the tied embedding and head
