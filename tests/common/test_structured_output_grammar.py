"""Structured output in the request bodies: each field becomes one llguidance grammar (checked
by running it over texts with a byte-level tokenizer), and what cannot be built is a 400 that
names its field."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
from openai.lib._pydantic import to_strict_json_schema
from pydantic import ValidationError

from llmq.common.errors import InvalidRequest
from llmq.common.serving import structured_output
from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.request_bodies import CompletionRequest
from llmq.common.validation import validation_error
from tests.structured_schemas import MODELS

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "hi"}]


class _ByteTokens:
    """One token per byte, and an end-of-sequence token: any text is exactly its bytes."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


TOKENIZER = LLTokenizer(TokenizerWrapper(_ByteTokens()))


def accepts(grammar: str, text: str) -> bool:
    """Whether ``text`` is a whole sentence of ``grammar``."""
    matcher = LLMatcher(TOKENIZER, grammar, log_level=0)
    return (
        matcher.consume_tokens(list(text.encode()))
        and matcher.is_accepting()
        and not matcher.is_error()
    )


def chat_grammar(**fields) -> str | None:
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})
    asyncio.run(body.prepare_grammar())
    return body.sampling_params(16, None).grammar


def completion_grammar(**fields) -> str | None:
    body = CompletionRequest.model_validate({"prompt": "x", **fields})
    asyncio.run(body.prepare_grammar())
    return body.sampling_params(16, None).grammar


def refusal(build, **fields) -> InvalidRequest:
    """The 400 a body gets: from validating it (as the routes do), or from building its
    grammar."""
    with pytest.raises((ValidationError, InvalidRequest)) as caught:
        build(**fields)
    if isinstance(caught.value, ValidationError):
        return validation_error(list(caught.value.errors()))
    return caught.value


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 3},
        "n": {"type": "integer", "minimum": 1, "maximum": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}


# ---- request -> grammar --------------------------------------------------------------------
def test_free_text_has_no_grammar():
    assert chat_grammar() is None
    assert chat_grammar(response_format={"type": "text"}) is None
    assert chat_grammar(response_format={}) is None
    assert completion_grammar() is None


@pytest.mark.parametrize("build", [chat_grammar, completion_grammar])
def test_every_field_form_builds_its_grammar(build):
    spec = {"name": "thing", "schema": SCHEMA, "strict": True, "description": "a thing"}
    for fields in (
        {"response_format": {"type": "json_schema", "json_schema": spec}},
        {"structured_outputs": {"json": SCHEMA}},
        {"structured_outputs": {"json": json.dumps(SCHEMA)}},
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA)},
    ):
        grammar = build(**fields)
        assert accepts(grammar, '{"name": "abc", "n": 12, "tags": ["a", "b"]}'), fields
        assert not accepts(grammar, '{"name": "abc", "n": 13, "tags": ["a"]}'), fields
    for fields in (
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"json_object": True}},
    ):
        grammar = build(**fields)
        assert accepts(grammar, '{"a": [1, {"b": null}], "c": "d"}'), fields
        assert not accepts(grammar, "[1]") and not accepts(grammar, '"a"'), fields
    for fields in (
        {"structured_outputs": {"regex": r"\d{3}-[a-z]+"}},
        {"guided_regex": r"\d{3}-[a-z]+"},
    ):
        grammar = build(**fields)
        assert accepts(grammar, "123-abc") and not accepts(grammar, "12-abc"), fields
    choices = ["yes", "no", 'say "hi"\n', "é"]
    for fields in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        grammar = build(**fields)
        assert all(accepts(grammar, c) for c in choices), fields
        assert not accepts(grammar, "maybe") and not accepts(grammar, "yesno"), fields
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]+/'
    for fields in ({"structured_outputs": {"grammar": lark}}, {"guided_grammar": lark}):
        grammar = build(**fields)
        assert accepts(grammar, "(1,22,3)") and not accepts(grammar, "(1,)"), fields


def test_json_whitespace_is_fixed_even_if_the_schema_asks_for_more():
    loose = {**SCHEMA, "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": "[ ]*"}}
    for schema in (SCHEMA, loose):
        grammar = chat_grammar(guided_json=schema)
        assert accepts(grammar, '{"name": "a", "n": 1, "tags": ["a"]}')
        for spaced in (
            '{"name":"a","n":1,"tags":["a"]}',
            '{ "name": "a", "n": 1, "tags": ["a"]}',
            '{"name": "a", "n": 1, "tags": ["a"]} ',
            '{\n  "name": "a", "n": 1, "tags": ["a"]}',
            '{"name":  "a", "n": 1, "tags": ["a"]}',
        ):
            assert not accepts(grammar, spaced), spaced


def test_schema_bounds_are_enforced():
    grammar = chat_grammar(guided_json=SCHEMA)
    good = '{"name": "abc", "n": 1, "tags": ["b"]}'
    assert accepts(grammar, good)
    for bad in (
        '{"name": "abcd", "n": 1, "tags": ["b"]}',  # maxLength
        '{"name": "abc", "n": 0, "tags": ["b"]}',  # minimum
        '{"name": "abc", "n": 1.5, "tags": ["b"]}',  # integer
        '{"name": "abc", "n": 1, "tags": []}',  # minItems
        '{"name": "abc", "n": 1, "tags": ["a", "b", "a"]}',  # maxItems
        '{"name": "abc", "n": 1, "tags": ["c"]}',  # enum
        '{"name": "abc", "n": 1}',  # required
        '{"name": "abc", "n": 1, "tags": ["b"], "x": 1}',  # additionalProperties
    ):
        assert not accepts(grammar, bad), bad


def test_pydantic_models_schemas_build_as_the_openai_sdk_sends_them():
    for model in MODELS:
        spec = {"name": model.__name__, "schema": to_strict_json_schema(model), "strict": True}
        grammar = chat_grammar(response_format={"type": "json_schema", "json_schema": spec})
        assert grammar and json.loads(grammar)["grammars"], model.__name__


def test_n_choices_share_the_grammar_built_once(monkeypatch):
    built = []
    real = structured_output.build_grammar

    def counting(constraint):
        built.append(constraint.param)
        return real(constraint)

    monkeypatch.setattr(structured_output, "build_grammar", counting)
    body = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "n": 3, "guided_regex": "a+"}
    )
    asyncio.run(body.prepare_grammar())
    grammars = {body.sampling_params(8, None).grammar for _ in range(3)}
    assert built == ["guided_regex"] and len(grammars) == 1 and None not in grammars


def test_a_large_schema_is_built_off_the_event_loop_and_a_small_one_on_it(monkeypatch):
    threads = []
    real = structured_output.build_grammar

    def recording(constraint):
        threads.append(threading.get_ident())
        return real(constraint)

    monkeypatch.setattr(structured_output, "build_grammar", recording)
    props = {f"field_{i}": {"type": "string", "maxLength": 8} for i in range(300)}
    large = {"type": "object", "properties": props}
    assert len(json.dumps(large)) > structured_output.INLINE_SOURCE_CHARS

    async def both() -> int:
        for schema in (SCHEMA, large):
            body = ChatCompletionRequest.model_validate(
                {"messages": MESSAGES, "guided_json": schema}
            )
            await body.prepare_grammar()
            assert body.grammar()
        return threading.get_ident()

    loop_thread = asyncio.run(both())
    assert threads[0] == loop_thread and threads[1] != loop_thread


# ---- 400s ----------------------------------------------------------------------------------
def _json_schema(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("build", [chat_grammar, completion_grammar])
@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type", "json_schema"),
        ({"response_format": "json"}, "response_format", "valid"),
        (
            {"response_format": _json_schema({"type": "foo"})},
            "response_format",
            "invalid JSON schema",
        ),
        (
            {"response_format": _json_schema({"type": "array", "uniqueItems": True})},
            "response_format",
            "uniqueItems",
        ),
        ({"response_format": _json_schema({"not": {"type": "string"}})}, "response_format", "not"),
        (
            {"response_format": _json_schema({"type": "integer", "minimum": 5, "maximum": 2})},
            "response_format",
            "minimum",
        ),
        (
            {"response_format": _json_schema({"type": "string", "pattern": "(?=a)b"})},
            "response_format",
            "look-around",
        ),
        (
            {"structured_outputs": {"json": "{not json"}},
            "structured_outputs.json",
            "not valid JSON",
        ),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "schema object"),
        (
            {"structured_outputs": {"json": 5}},
            "structured_outputs.json",
            "a JSON schema object or a string",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "invalid regex"),
        ({"structured_outputs": {"regex": r"(a)\1"}}, "structured_outputs.regex", "backreferences"),
        (
            {"structured_outputs": {"grammar": "start: foo"}},
            "structured_outputs.grammar",
            "invalid grammar",
        ),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        (
            {"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs.structural_tag",
            "not permitted",
        ),
        ({"guided_json": [1]}, "guided_json", "a JSON schema object or a string"),
        ({"guided_json": {"type": "strin"}}, "guided_json", "invalid JSON schema"),
        ({"guided_regex": 5}, "guided_regex", "string"),
        ({"guided_regex": "[a-"}, "guided_regex", "invalid regex"),
        ({"guided_choice": "yes"}, "guided_choice", "list"),
        ({"guided_choice": ["a", 1]}, "guided_choice.1", "string"),
        ({"guided_grammar": 'start: "unclosed'}, "guided_grammar", "invalid grammar"),
        (
            {"guided_json": {"type": "object"}, "guided_regex": "a"},
            "guided_regex",
            "one structured output",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
            "response_format and structured_outputs.regex",
        ),
    ],
)
def test_what_cannot_be_built_is_a_400_naming_the_field(build, fields, param, says):
    error = refusal(build, **fields)
    assert error.status == 400 and error.param == param, (error.param, error.message)
    assert says in error.message, error.message
    assert error.message.count(param) <= 2, error.message  # named, not repeated over and over


def test_free_text_response_format_goes_with_another_constraint():
    grammar = chat_grammar(response_format={"type": "text"}, guided_regex="a+")
    assert accepts(grammar, "aaa")
