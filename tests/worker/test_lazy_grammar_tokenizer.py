"""A worker's grammar tokenizer (``grammar_compiler.LazyTokenizer``): not loaded until a grammar
comes, then loaded once for every grammar after it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from llmq.common.model_files import load_tokenizer
from llmq.common.sampling_params import SamplingParams
from llmq.worker.grammar_compiler import LazyTokenizer
from llmq.worker.llm_engine import EngineConfig, LLMEngine
from llmq.worker.loading.model_loader import eos_token_ids, load_causal_lm
from tests.worker.test_constrained_engine import (
    MAX_TOKENS,
    PERSON,
    POINTS,
    json_grammar,
    run,
    text_of,
)

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def llama_case(llama_dir):
    path = str(llama_dir)
    return load_causal_lm(path, "float32", "cpu"), load_tokenizer(path)


def test_a_lazy_tokenizer_loads_with_the_first_grammar_only(llama_case):
    """A worker holds no grammar tokenizer until a grammar comes; then it loads it once."""
    model, tokenizer = llama_case
    loads = []

    def load():
        loads.append(1)
        return tokenizer

    lazy = LazyTokenizer(load, len(tokenizer))
    engine = LLMEngine(model, EngineConfig(num_blocks=64), eos_token_ids(model, tokenizer), lazy)
    engine.add_request("free", [4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    run(engine)
    assert loads == []
    for k, schema in enumerate((POINTS, PERSON)):
        params = SamplingParams(temperature=1.0, seed=k, max_tokens=MAX_TOKENS)
        params.grammar = json_grammar(schema)
        engine.add_request(f"r{k}", [4, 5, 6], params)
        jsonschema.validate(json.loads(text_of(tokenizer, run(engine)[f"r{k}"])), schema)
    assert loads == [1]
