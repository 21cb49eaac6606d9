"""`llmq worker` with LLMQ_MODEL set to a GPTQ checkpoint folder (4-bit, act order, no
quantization setting): through the API, concurrent chats answer the greedy tokens of the same
checkpoint loaded in-process and stepped on each prompt alone."""

from __future__ import annotations

import asyncio

import pytest

from llmq.common.model_files import load_tokenizer
from llmq.common.sampling_params import SamplingParams
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import load_causal_lm
from tests.api.api_stack import aclient, stack

pytest.importorskip("compressed_tensors")  # the checkpoint writers' module imports it
from tests.worker.test_quant_checkpoints import write_checkpoint  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OUTPUT_TOKENS = 12
TALKS = [
    [{"role": "user", "content": "What does XREADGROUP do?"}],
    [{"role": "user", "content": "def fibonacci(n):"}],
    [{"role": "user", "content": "What does XREADGROUP do? And XACK?"}],
]


@pytest.fixture(scope="module")
def gptq_dir(llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gptq-api")
    write_checkpoint(folder, llama_dir, "llama", "gptq4-actorder")
    return folder


def test_a_gptq_folder_is_served_quantized_through_the_api(gptq_dir, logs):
    tok = load_tokenizer(str(gptq_dir))
    model = load_causal_lm(str(gptq_dir), "float32", "cpu")
    assert model.config.llmq_quantization == "checkpoint"
    engine = LLMEngine(model, EngineConfig(num_blocks=64), eos_token_ids=set())
    assert engine.runner.forward.layout == "checkpoint"
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    prompts = [
        list(tok.apply_chat_template(t, add_generation_prompt=True, return_dict=False))
        for t in TALKS
    ]
    expected = [engine.generate([p], params)[0] for p in prompts]
    assert len({tuple(t) for t in expected}) == len(expected)
    texts = [tok.decode(t, skip_special_tokens=True) for t in expected]

    async def ask(client, messages):
        return await client.chat.completions.create(
            model=s.model,
            messages=messages,
            max_tokens=OUTPUT_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )

    async def together():
        client = aclient(s.base, timeout=120)
        return await asyncio.gather(*(ask(client, t) for t in TALKS))

    with stack(gptq_dir, logs, "w-gptq", dict(kv_blocks=16), {}) as s:
        answers = asyncio.run(together())
    assert [a.choices[0].message.content for a in answers] == texts
