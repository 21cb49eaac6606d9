"""Constrained decoding in the engine: a grammar's token mask is the only thing that can make a
random model's output valid, so every output here is checked against its schema, regex or
choice. Greedy and sampled, alone and beside unconstrained requests (which still equal
``model.generate``), through preemption, chunked prefill, the prefix cache and a resume."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch
from llguidance import LLMatcher

from llmq.common.model_files import load_tokenizer
from llmq.common.protocol import EngineRequest
from llmq.common.sampling_params import SamplingParams
from llmq.worker.backends import GenerationBackend
from llmq.worker.engine.sequence import FinishReason
from llmq.worker.llm_engine import EngineConfig, LLMEngine, RequestOutput
from llmq.worker.loading.model_loader import eos_token_ids, load_causal_lm
from llmq.worker.request_error import RequestError
from llmq.worker.runner.token_mask import TokenMask, apply_token_mask
from tests.worker.test_engine_exact import reference_generate

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "floor": {"type": "integer", "minimum": -2, "maximum": 40},
                "active": {"type": "boolean"},
            },
            "required": ["zip", "floor", "active"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
POINTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9},
            "label": {"enum": ["a", "b"]},
        },
        "required": ["x", "label"],
        "additionalProperties": False,
    },
    "minItems": 2,
    "maxItems": 4,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue"]
# Bounded schemas, no free whitespace: PERSON is at most ~190 characters, so it must close
# well within this many tokens.
MAX_TOKENS = 400


def json_grammar(schema: dict) -> str:
    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def choice_grammar(choices: list[str]) -> str:
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_case(request):
    path = str(request.getfixturevalue(f"{request.param}_dir"))
    model = load_causal_lm(path, "float32", "cpu")
    tokenizer = load_tokenizer(path)
    return model, tokenizer


@pytest.fixture(scope="module")
def reference_model(model_case):
    """A copy of the model that no engine touched (an engine sets its attention in place)."""
    return load_causal_lm(model_case[0].name_or_path, "float32", "cpu")


@pytest.fixture(scope="module")
def llama_case(llama_dir):
    path = str(llama_dir)
    return load_causal_lm(path, "float32", "cpu"), load_tokenizer(path)


def make_engine(case, **config) -> LLMEngine:
    model, tokenizer = case
    config.setdefault("num_blocks", 256)
    return LLMEngine(
        model, EngineConfig(**config), eos_token_ids(model, tokenizer), tokenizer=tokenizer
    )


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until every request finished; each request's outputs, in order."""
    outputs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outputs.setdefault(o.request_id, []).append(o)
    return outputs


def text_of(tokenizer, outs: list[RequestOutput]) -> str:
    assert outs[-1].finish_reason is FinishReason.STOP, outs[-1]
    tokens = [t for o in outs for t in o.token_ids]
    return tokenizer.decode(tokens, skip_special_tokens=True)


SAMPLINGS = {
    "greedy": [SamplingParams(temperature=0.0)],
    "sampled": [SamplingParams(temperature=1.0, seed=s) for s in range(3)],
    "top_p_k_min_p": [
        SamplingParams(temperature=1.3, top_p=0.9, top_k=40, min_p=0.01, seed=7),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, logit_bias={5: 3.0}, seed=8),
    ],
}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_json_schema_outputs_are_valid(model_case, sampling):
    engine = make_engine(model_case)
    vocab = engine.vocab_size
    cases = [(schema, params) for schema in (PERSON, POINTS) for params in SAMPLINGS[sampling]]
    for k, (schema, params) in enumerate(cases):
        params = SamplingParams(**{**params.to_dict(), "max_tokens": MAX_TOKENS})
        params.grammar = json_grammar(schema)
        engine.add_request(f"r{k}", prompts(1, 5 + 3 * k, vocab, seed=k)[0], params)
    outputs = run(engine)
    for k, (schema, _) in enumerate(cases):
        value = json.loads(text_of(model_case[1], outputs[f"r{k}"]))
        jsonschema.validate(value, schema)


def test_regex_and_choice(model_case):
    engine = make_engine(model_case)
    vocab = engine.vocab_size
    grammars = {"regex": LLMatcher.grammar_from_regex(REGEX), "choice": choice_grammar(CHOICES)}
    for seed in range(4):
        for name, grammar in grammars.items():
            params = SamplingParams(temperature=0.0 if seed == 0 else 1.0, seed=seed)
            params.max_tokens, params.grammar = 64, grammar
            engine.add_request(f"{name}-{seed}", prompts(1, 9, vocab, seed)[0], params)
    outputs = run(engine)
    for seed in range(4):
        assert re.fullmatch(REGEX, text_of(model_case[1], outputs[f"regex-{seed}"]))
        assert text_of(model_case[1], outputs[f"choice-{seed}"]) in CHOICES


def test_unconstrained_neighbour_still_equals_generate(model_case, reference_model):
    engine = make_engine(model_case)
    free = prompts(3, 20, engine.vocab_size, seed=11)
    for k, prompt in enumerate(free):
        free_params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        engine.add_request(f"free{k}", prompt, free_params)
        constrained = SamplingParams(temperature=1.0, seed=k, max_tokens=MAX_TOKENS)
        constrained.grammar = json_grammar(PERSON)
        engine.add_request(f"json{k}", prompt, constrained)
    outputs = run(engine)
    with torch.inference_mode():
        for k, prompt in enumerate(free):
            got = [t for o in outputs[f"free{k}"] for t in o.token_ids]
            expected = reference_generate(reference_model, prompt, 20)
            assert got == expected
            jsonschema.validate(json.loads(text_of(model_case[1], outputs[f"json{k}"])), PERSON)


def test_preemption_chunked_prefill_and_prefix_cache(llama_case):
    # 12 blocks of 16 tokens for 6 requests of 60-token prompts (a shared 48-token prefix):
    # they preempt each other; 24 tokens a step chunks every prefill.
    engine = make_engine(llama_case, num_blocks=24, max_batch_tokens=24, max_batch_size=6)
    vocab = engine.vocab_size
    shared = prompts(1, 48, vocab, seed=3)[0]
    for k, tail in enumerate(prompts(6, 12, vocab, seed=4)):
        params = SamplingParams(temperature=1.0, seed=k, max_tokens=MAX_TOKENS)
        params.grammar = json_grammar(POINTS if k % 2 else PERSON)
        engine.add_request(f"r{k}", shared + tail, params)
    outputs = run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_hits > 0
    for k in range(6):
        value = json.loads(text_of(llama_case[1], outputs[f"r{k}"]))
        jsonschema.validate(value, POINTS if k % 2 else PERSON)


def test_resumed_request_continues_its_grammar(llama_case):
    engine = make_engine(llama_case)
    prompt = prompts(1, 10, engine.vocab_size, seed=5)[0]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=15)
    params.grammar = json_grammar(PERSON)
    engine.add_request("first", prompt, params)
    first = run(engine)["first"]
    assert first[-1].finish_reason is FinishReason.LENGTH
    prior = [t for o in first for t in o.token_ids]
    params.max_tokens = MAX_TOKENS
    engine.add_request("resumed", prompt, params, output_token_ids=prior)
    rest = run(engine)["resumed"]
    tokens = prior + [t for o in rest for t in o.token_ids]
    assert rest[-1].finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(llama_case[1].decode(tokens, skip_special_tokens=True)), PERSON)


def test_resume_with_tokens_the_grammar_refuses_fails_that_request(llama_case):
    engine = make_engine(llama_case)
    tokenizer = llama_case[1]
    params = SamplingParams(max_tokens=20, grammar=choice_grammar(CHOICES))
    engine.add_request("bad", [5, 6, 7], params, output_token_ids=tokenizer.encode("pink"))
    engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=20, grammar=params.grammar))
    outputs = run(engine)
    (bad,) = outputs["bad"]
    assert bad.finish_reason is FinishReason.ABORT and bad.error.code == "invalid_grammar"
    assert "do not match its grammar" in bad.error.message
    assert text_of(tokenizer, outputs["good"]) in CHOICES
    assert not engine.requests and not engine.has_unfinished()


def test_one_grammar_is_built_once(llama_case):
    engine = make_engine(llama_case, max_batch_size=16)
    grammar = json_grammar(POINTS)
    for k, prompt in enumerate(prompts(40, 6, engine.vocab_size, seed=9)):
        params = SamplingParams(temperature=1.0, seed=k, max_tokens=MAX_TOKENS, grammar=grammar)
        engine.add_request(f"r{k}", prompt, params)
    outputs = run(engine)
    assert engine.constrained.compiler.num_builds == 1
    for k in range(40):
        jsonschema.validate(json.loads(text_of(llama_case[1], outputs[f"r{k}"])), POINTS)


def test_invalid_grammar_fails_only_its_request(llama_case):
    engine = make_engine(llama_case)
    engine.add_request("bad", [4, 5], SamplingParams(grammar=LLMatcher.grammar_from_lark("x")))
    engine.add_request("free", [4, 5], SamplingParams(max_tokens=5, ignore_eos=True))
    outputs = run(engine)
    (bad,) = outputs["bad"]
    assert bad.finish_reason is FinishReason.ABORT
    assert bad.error.type == "invalid_request_error" and bad.error.code == "invalid_grammar"
    assert bad.error.message.startswith("invalid grammar: ") and "\n" not in bad.error.message
    assert sum(len(o.token_ids) for o in outputs["free"]) == 5
    assert not engine.requests


def test_logprobs_come_from_the_masked_distribution(llama_case):
    engine = make_engine(llama_case)
    tokenizer = llama_case[1]
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=16, logprobs=5)
    params.grammar = choice_grammar(["yes", "no"])
    engine.add_request("r", [7, 8, 9], params)
    outs = run(engine)["r"]
    text = text_of(tokenizer, outs)
    assert text in ("yes", "no")
    first = outs[0].logprobs[0]
    # Only tokens the grammar allows, and they are all of them (at most "y", "ye", "yes", "n",
    # "no"): the masked distribution sums to one over them.
    for t, _ in first.top:
        assert tokenizer.decode([t]) and any(
            w.startswith(tokenizer.decode([t])) for w in ("yes", "no")
        )
    assert float(torch.tensor([v for _, v in first.top]).exp().sum()) == pytest.approx(
        1.0, abs=1e-4
    )
    last = outs[-1].logprobs[0]  # the grammar's last step: often one token left
    assert last.logprob <= 0.0 and all(v > float("-inf") for _, v in last.top)


def test_abort_while_the_grammar_builds_and_no_tokenizer(llama_case):
    engine = make_engine(llama_case)
    engine.add_request("r", [4, 5], SamplingParams(grammar=json_grammar(PERSON)))
    assert engine.num_waiting == 1 and engine.has_unfinished()
    out = engine.abort_request("r")
    assert out.finish_reason is FinishReason.ABORT and not engine.has_unfinished()
    assert engine.step() == []
    bare = LLMEngine(llama_case[0], EngineConfig(num_blocks=16))
    with pytest.raises(RequestError, match="constrained"):
        bare.add_request("r", [4, 5], SamplingParams(grammar=json_grammar(PERSON)))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
        ),
    ],
)
def test_apply_token_mask_matches_a_plain_mask(device):
    gen = torch.Generator().manual_seed(0)
    width = 1000  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(5, width, generator=gen).to(device)
    allowed = torch.rand(3, width, generator=gen) < 0.3
    rows = [0, 2, 3]
    padded = torch.zeros(3, 1024, dtype=torch.bool)
    padded[:, :width] = allowed
    weights = 1 << torch.arange(32, dtype=torch.int64)
    words = (padded.view(3, 32, 32).long() * weights).sum(-1)
    bitmask = words.to(torch.int64).numpy().astype("int64").astype("uint32").view("int32")
    expected = logits.clone()
    for k, r in enumerate(rows):
        expected[r, ~allowed[k].to(device)] = float("-inf")
    apply_token_mask(logits, TokenMask(rows, bitmask))
    assert torch.equal(logits, expected)


def test_min_tokens_bans_yield_to_the_grammar(llama_case):
    # After "a" the grammar allows "b" or the end; min_tokens bans the end and the stop token
    # bans "b": the row has no token left, and the grammar's own mask decides.
    engine = make_engine(llama_case)
    tokenizer = llama_case[1]
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=[b])
    params.logit_bias = {a: 100.0}
    params.grammar = choice_grammar(["a", "ab"])
    engine.add_request("r", [9, 10, 11], params)
    outs = run(engine)["r"]
    assert outs[0].token_ids == [a]
    assert text_of(tokenizer, outs) in ("a", "ab")


def test_backend_reports_a_grammar_failure_as_that_requests_error(llama_case):
    backend = GenerationBackend(make_engine(llama_case))
    bad = SamplingParams(grammar=LLMatcher.grammar_from_regex("(unclosed"))
    backend.add(EngineRequest("bad", [4, 5], bad), [])
    backend.add(EngineRequest("good", [4, 5], SamplingParams(max_tokens=3, ignore_eos=True)), [])
    messages: dict[str, list] = {}
    while backend.has_unfinished():
        for rid, msg in backend.step():
            messages.setdefault(rid, []).append(msg)
    (msg,) = messages["bad"]
    assert msg.done and msg.usage is None and msg.tokens == []
    assert msg.error.type == "invalid_request_error" and msg.error.code == "invalid_grammar"
    assert messages["good"][-1].finish_reason == "length" and messages["good"][-1].error is None


def test_a_matcher_error_mid_generation_fails_only_that_request(llama_case):
    engine = make_engine(llama_case)
    tokenizer = llama_case[1]
    grammar = LLMatcher.grammar_from_regex("[0-9]{6}")
    for rid in ("broken", "fine"):
        engine.add_request(rid, [4, 5, 6], SamplingParams(max_tokens=20, grammar=grammar))
    outputs: dict[str, list[RequestOutput]] = {}
    while "broken" not in engine.constrained.matchers:
        for o in engine.step():
            outputs.setdefault(o.request_id, []).append(o)
    # A token its grammar refuses puts the matcher in its error state, as a runtime fault would.
    assert not engine.constrained.matchers["broken"].consume_token(tokenizer.encode("x")[0])
    for rid, outs in run(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    failure = outputs["broken"][-1]
    assert failure.finish_reason is FinishReason.ABORT and failure.token_ids == []
    assert failure.error.code == "grammar_error" and "\n" not in failure.error.message
    assert failure.num_output_tokens == sum(len(o.token_ids) for o in outputs["broken"])
    assert re.fullmatch("[0-9]{6}", text_of(tokenizer, outputs["fine"]))
    assert not engine.requests and engine.block_manager.num_used_blocks == 0


def test_a_grammar_being_built_stalls_no_other_request(llama_case):
    engine = make_engine(llama_case)
    compiler = engine.constrained.compiler
    grammar = LLMatcher.grammar_from_regex("[0-9]{4}")
    built = compiler.template(grammar).result()
    held: Future = Future()  # a build that has not finished yet
    compiler.template = lambda _grammar: held
    engine.add_request("slow", [4, 5, 6], SamplingParams(max_tokens=10, grammar=grammar))
    engine.add_request("free", [4, 5, 6], SamplingParams(max_tokens=6, ignore_eos=True))
    free = run_until_finished(engine, "free")
    assert sum(len(o.token_ids) for o in free) == 6
    assert engine.has_unfinished() and engine.num_waiting == 1 and engine.num_running == 0
    held.set_result(built)
    slow = run(engine)["slow"]
    assert re.fullmatch("[0-9]{4}", text_of(llama_case[1], slow))


def run_until_finished(engine: LLMEngine, request_id: str) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while not outs or not outs[-1].finished:
        outs.extend(o for o in engine.step() if o.request_id == request_id)
    return outs
