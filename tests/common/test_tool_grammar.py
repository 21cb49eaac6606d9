"""tool_choice "required" over tools whose schemas have definitions: each tool's ``$defs`` and
``definitions`` move to the root of the array's schema, renamed apart where two tools use one
name for different schemas, so each tool's references still reach its own definitions. Checked
with jsonschema on the merged schema and with llguidance on the grammar built from it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from llmq.common.serving.tool_grammar import required_schema, tool_grammar
from llmq.common.serving.tool_request import FunctionTool
from tests.common.test_tool_request import _accepts

pytestmark = pytest.mark.unit


def tool(name: str, parameters: dict[str, Any]) -> FunctionTool:
    return FunctionTool.model_validate(
        {"type": "function", "function": {"name": name, "parameters": parameters}}
    )


def enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def holder(ref: str, key: str = "color", defs: dict | None = None, keyword: str = "$defs"):
    """An object whose one property is ``ref``; ``defs`` under ``keyword``."""
    schema = {
        "type": "object",
        "properties": {key: {"$ref": ref}},
        "required": [key],
        "additionalProperties": False,
    }
    return schema | ({keyword: defs} if defs else {})


# Pydantic's shape: a model holding a sub-model that holds an enum, the enum referenced from
# inside the sub-model's definition.
INNER = holder("#/$defs/Color")
WARM = holder("#/$defs/Inner", "inner", {"Inner": INNER, "Color": enum("red", "orange")})
COLD = holder("#/$defs/Inner", "inner", {"Inner": INNER, "Color": enum("blue", "green")})
SIZED = holder("#/$defs/Size", "size", {"Size": enum("S", "M")})


def calls(*pairs: tuple[str, dict]) -> list[dict]:
    return [{"name": name, "parameters": parameters} for name, parameters in pairs]


class Checks:
    """The required choice over ``tools``: its schema (checked as a JSON schema) and grammar."""

    def __init__(self, *tools: FunctionTool):
        self.schema = required_schema(list(tools), parallel=True)
        Draft202012Validator.check_schema(self.schema)
        self.validator = Draft202012Validator(self.schema)
        self.grammar = tool_grammar(list(tools), None, parallel=True)

    def accepts(self, value: list[dict]) -> bool:
        valid = self.validator.is_valid(value)
        assert _accepts(self.grammar, json.dumps(value, separators=(",", ":"))) == valid, value
        return valid


def inner(color: str) -> dict:
    return {"inner": {"color": color}}


def test_each_tools_definitions_reach_the_root():
    checks = Checks(tool("warm", WARM), tool("sized", SIZED))
    assert set(checks.schema["$defs"]) == {"Inner", "Color", "Size"}
    assert checks.accepts(calls(("warm", inner("red")), ("sized", {"size": "S"})))
    assert not checks.accepts(calls(("warm", inner("blue"))))
    assert not checks.accepts(calls(("sized", {"size": "L"})))


def test_one_name_for_two_schemas_is_renamed_apart():
    """Both tools name their enum Color and their sub-model Inner; the Inner definitions are
    the same text but mean different things (each reaches its own Color), so both are renamed
    apart, while a third tool with the first one's schema shares its definitions."""
    checks = Checks(tool("warm", WARM), tool("cold", COLD), tool("again", WARM))
    assert set(checks.schema["$defs"]) == {"Inner", "Color", "Inner_2", "Color_2"}
    for name, good, bad in (("warm", "red", "blue"), ("cold", "green", "orange")):
        assert checks.accepts(calls((name, inner(good))))
        assert not checks.accepts(calls((name, inner(bad))))
    assert checks.accepts(calls(("again", inner("orange")), ("cold", inner("blue"))))


def test_definitions_nested_references_and_pointers_into_the_tool():
    """``definitions`` (draft 7's name) beside ``$defs`` of the same name, a recursive
    definition, a name to escape in the pointer, and references to the tool's own root and
    properties: each moved where its target now lives."""
    node = {
        "type": "object",
        "properties": {
            "label": {"$ref": "#/definitions/a~1b%20c"},
            "next": {"anyOf": [{"$ref": "#/definitions/Node"}, {"type": "null"}]},
        },
        "required": ["label", "next"],
        "additionalProperties": False,
    }
    node["properties"]["same"] = {"$ref": "#/properties/tail"}
    defs = {"Node": node, "a/b c": enum("x", "y")}
    listed = holder("#/definitions/Node", "head", defs, keyword="definitions")
    listed["properties"]["tail"] = {"$ref": "#/$defs/Node"}
    listed["$defs"] = {"Node": enum("end")}  # one name under both keywords
    checks = Checks(tool("listed", listed), tool("sized", SIZED))
    assert set(checks.schema["$defs"]) == {"Node", "Node_2", "a/b c", "Size"}
    # (in the schema's order of properties, which the grammar keeps)
    chain = {"label": "x", "next": {"label": "y", "next": None, "same": "end"}, "same": "end"}
    assert checks.accepts(calls(("listed", {"head": chain, "tail": "end"})))
    assert not checks.accepts(calls(("listed", {"head": chain | {"label": "z"}})))
    deep = chain | {"next": chain | {"same": "more"}, "same": "end"}
    assert not checks.accepts(calls(("listed", {"head": deep, "tail": "end"})))


def test_tools_without_definitions_are_unchanged():
    plain = {"type": "object", "properties": {"color": enum("red")}}
    schema = required_schema([tool("empty", SIZED | {"$defs": {}}), tool("p", plain)], False)
    assert "$defs" not in schema and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == plain
