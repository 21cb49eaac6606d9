"""Structured output: the request fields that constrain what is generated (OpenAI's
``response_format``, vLLM's ``structured_outputs`` and its older ``guided_*`` fields) and the one
llguidance grammar each becomes, built and validated before anything is enqueued."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

from llguidance import LLMatcher
from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmq.common.errors import InvalidRequest

if TYPE_CHECKING:  # a TypedDict of llguidance's stubs only
    from llguidance._lib import JsonCompileOptions

# JSON is generated compact, with one space after ',' and ':' and none elsewhere: free
# whitespace lets a model (a random one always) loop on spaces and newlines until max_tokens.
# Overrides, so that a schema's "x-guidance" cannot loosen them; not lenient: a keyword
# llguidance cannot enforce is refused, not ignored.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "whitespace_pattern": None,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}
ANY_JSON_OBJECT = '{"type": "object"}'

# Building and validating a grammar takes time linear in the schema (docs/performance.md,
# "Structured output"): above this many characters of source it runs in a thread (llguidance
# drops the GIL), so that a large schema does not stall the loop.
INLINE_SOURCE_CHARS = 4096
MAX_ERROR_CHARS = 500

JsonSchemaSource = dict[str, Any] | str  # a schema object, or its JSON text
Choices = Annotated[list[str], Field(min_length=1)]


class JsonSchemaSpec(BaseModel):
    """OpenAI's ``response_format.json_schema``; the schema is enforced whatever ``strict``
    says."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str
    json_schema: dict[str, Any] = Field(alias="schema")  # "schema" would shadow BaseModel's
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs json_schema: {name, schema}")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one constraint. ``grammar`` is a grammar in
    llguidance's Lark dialect."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: JsonSchemaSource | None = Field(None, alias="json")
    regex: str | None = None
    choice: Choices | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in self.model_fields_set if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object")
        return self


class ConstrainedFields(Protocol):
    """The fields of a request body that ask for structured output."""

    response_format: ResponseFormat | None
    structured_outputs: StructuredOutputs | None
    guided_json: JsonSchemaSource | None
    guided_regex: str | None
    guided_choice: list[str] | None
    guided_grammar: str | None


@dataclass(frozen=True, slots=True)
class Constraint:
    """One constraint of a request: where it came from (the ``param`` of its 400s), what kind of
    source it is, and that source's text."""

    param: str
    kind: Literal["json_schema", "regex", "lark"]
    source: str


def _json_constraint(param: str, schema: JsonSchemaSource) -> Constraint:
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequest(f"{param} is not valid JSON: {exc}", param) from None
        if not isinstance(parsed, dict):
            raise InvalidRequest(f"{param} must be a JSON schema object", param)
        return Constraint(param, "json_schema", schema)
    return Constraint(param, "json_schema", json.dumps(schema))


def _choice_constraint(param: str, choices: list[str]) -> Constraint:
    # A Lark string literal takes JSON's escapes (as llguidance's own grammar_from("choice")).
    return Constraint(param, "lark", "start: " + " | ".join(json.dumps(c) for c in choices))


def _response_format(fmt: ResponseFormat) -> Constraint | None:
    if fmt.type == "json_object":
        return Constraint("response_format", "json_schema", ANY_JSON_OBJECT)
    if fmt.type == "json_schema" and fmt.json_schema is not None:
        return _json_constraint("response_format", fmt.json_schema.json_schema)
    return None


def _structured_outputs(so: StructuredOutputs) -> Constraint:
    if so.json_schema is not None:
        return _json_constraint("structured_outputs.json", so.json_schema)
    if so.regex is not None:
        return Constraint("structured_outputs.regex", "regex", so.regex)
    if so.choice is not None:
        return _choice_constraint("structured_outputs.choice", so.choice)
    if so.grammar is not None:
        return Constraint("structured_outputs.grammar", "lark", so.grammar)
    return Constraint("structured_outputs.json_object", "json_schema", ANY_JSON_OBJECT)


def requested_constraint(body: ConstrainedFields) -> Constraint | None:
    """The body's one constraint (None: free text); two at once are refused."""
    found: list[Constraint] = []
    if body.response_format is not None and (c := _response_format(body.response_format)):
        found.append(c)
    if body.structured_outputs is not None:
        found.append(_structured_outputs(body.structured_outputs))
    if body.guided_json is not None:
        found.append(_json_constraint("guided_json", body.guided_json))
    if body.guided_regex is not None:
        found.append(Constraint("guided_regex", "regex", body.guided_regex))
    if body.guided_choice is not None:
        found.append(_choice_constraint("guided_choice", body.guided_choice))
    if body.guided_grammar is not None:
        found.append(Constraint("guided_grammar", "lark", body.guided_grammar))
    if len(found) > 1:
        names = " and ".join(c.param for c in found)
        raise InvalidRequest(
            f"one structured output constraint per request; got {names}", found[1].param
        )
    return found[0] if found else None


def build_grammar(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint``, validated (a 400 naming its field if it is
    invalid or asks for what llguidance does not enforce)."""
    try:
        if constraint.kind == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(constraint.source, overrides=JSON_OPTIONS)
        elif constraint.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(constraint.source)
        else:
            grammar = LLMatcher.grammar_from_lark(constraint.source)
    except ValueError as exc:
        raise _invalid(constraint, str(exc)) from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise _invalid(constraint, messages[0] if messages else "invalid")
    return grammar


def _invalid(constraint: Constraint, detail: str) -> InvalidRequest:
    what = {"json_schema": "JSON schema", "regex": "regex", "lark": "grammar"}[constraint.kind]
    detail = detail.strip()
    if len(detail) > MAX_ERROR_CHARS:
        detail = detail[:MAX_ERROR_CHARS] + "..."
    return InvalidRequest(f"{constraint.param}: invalid {what}: {detail}", constraint.param)


async def grammar_for(body: ConstrainedFields) -> str | None:
    """The body's grammar (None: unconstrained); a large one is built in a thread."""
    constraint = requested_constraint(body)
    if constraint is None:
        return None
    if len(constraint.source) <= INLINE_SOURCE_CHARS:
        return build_grammar(constraint)
    return await asyncio.to_thread(build_grammar, constraint)
