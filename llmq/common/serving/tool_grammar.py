"""The grammar that makes a forced tool choice come true: for a named function, its arguments
object; for "required", a JSON array of ``{"name": <a tool>, "parameters": <its arguments>}``
(one item unless parallel calls are allowed), as vLLM forces them, the tools' ``$defs`` carried
to the array's root. The arguments then always parse and follow the tool's schema."""

from __future__ import annotations

from typing import Any

from llguidance import LLMatcher

from llmq.common.errors import InvalidRequest
from llmq.common.serving.tool_defs import merge_schemas
from llmq.common.serving.tool_request import FunctionTool

# Compact JSON: no whitespace for the model to wander in.
_JSON_OPTIONS = {"whitespace_flexible": False}


def call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }


def required_schema(tools: list[FunctionTool], parallel: bool) -> dict[str, Any]:
    """The array of calls; each tool's definitions carried to its root (see tool_defs)."""
    place = [["items", "anyOf", str(i), "properties", "parameters"] for i in range(len(tools))]
    parameters, defs = merge_schemas([t.function.schema() for t in tools], place)
    calls = [call_schema(t.function.name, p) for t, p in zip(tools, parameters, strict=True)]
    array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    if defs:
        array["$defs"] = defs
    return array


def tool_grammar(tools: list[FunctionTool], named: str | None, parallel: bool) -> str:
    """The llguidance grammar of a forced choice (``named``: that function's arguments); a
    schema llguidance cannot compile is a 400 naming ``tools``."""
    if named is not None:
        tool = next(t for t in tools if t.function.name == named)
        schema = tool.function.schema()
    else:
        schema = required_schema(tools, parallel)
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise InvalidRequest(
            f"the tools' parameters are not a usable JSON schema: {exc}", "tools"
        ) from exc
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequest(
            f"the tools' parameters are not a usable JSON schema: {error}", "tools"
        )
    return grammar
