"""Several tools' schemas as parts of one JSON schema document: a ``$ref`` is read from the root
of the document it sits in, so a tool's ``$defs`` (and ``definitions``) must move to the new
root, renamed apart where two tools use one name for different schemas, and every local
``$ref`` of the tool rewritten to where its target now lives."""

from __future__ import annotations

import copy
import json
from typing import Any
from urllib.parse import quote, unquote

DEFS_KEYWORDS = ("$defs", "definitions")
# Keywords whose values are data, not schemas: a "$ref" key in them is no reference.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})

DefKey = tuple[str, str]  # (the keyword it was under, its name)


def _tokens(ref: str) -> list[str] | None:
    """The JSON pointer of a document-local reference as its tokens; None for any other."""
    if not ref.startswith("#"):
        return None
    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        return None  # an anchor ("#name"): not a pointer
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer.split("/")[1:]]


def _ref(tokens: list[str]) -> str:
    escaped = (t.replace("~", "~0").replace("/", "~1") for t in tokens)
    return "#" + "".join("/" + quote(t, safe="!$&'()*+,;=:@-._~") for t in escaped)


def _refs(node: Any, found: list[str]) -> list[str]:
    """Every ``$ref`` string in a schema, at any depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                found.append(value)
            elif key not in _DATA_KEYWORDS:
                _refs(value, found)
    elif isinstance(node, list):
        for item in node:
            _refs(item, found)
    return found


def _rewritten(node: Any, move) -> Any:
    if isinstance(node, dict):
        return {
            k: move(v)
            if k == "$ref" and isinstance(v, str)
            else (v if k in _DATA_KEYWORDS else _rewritten(v, move))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rewritten(item, move) for item in node]
    return node


class _Tool:
    """One tool's schema with its definitions taken out; ``at``: the pointer tokens of where
    the schema sits in the merged document."""

    def __init__(self, schema: dict[str, Any], at: list[str], index: int):
        self.schema = copy.deepcopy(schema)
        self.at = at
        self.index = index
        self.defs: dict[DefKey, Any] = {}
        for keyword in DEFS_KEYWORDS:
            if isinstance(found := self.schema.get(keyword), dict):
                self.defs |= {(keyword, name): d for name, d in found.items()}
                del self.schema[keyword]
        self.names: dict[DefKey, str] = {}  # each definition's name in the merged $defs

    def target(self, ref: str) -> DefKey | list[str] | None:
        """A local reference's definition (by key) or other pointer (its tokens)."""
        tokens = _tokens(ref)
        if tokens is None:
            return None
        if len(tokens) >= 2 and (tokens[0], tokens[1]) in self.defs:
            return (tokens[0], tokens[1])
        return tokens

    def signature(self, key: DefKey) -> str:
        """What a definition means: it and every definition it reaches; one that points
        elsewhere in its tool's schema means something only there."""
        reached, todo, own = {}, [key], False
        while todo:
            k = todo.pop()
            if k in reached:
                continue
            reached[k] = self.defs[k]
            for ref in _refs(self.defs[k], []):
                target = self.target(ref)
                if isinstance(target, tuple):
                    todo.append(target)
                elif target is not None:
                    own = True
        closure = sorted((f"{kw}/{name}", d) for (kw, name), d in reached.items())
        return json.dumps([self.index if own else None, closure], sort_keys=True)

    def move(self, ref: str) -> str:
        target = self.target(ref)
        if isinstance(target, tuple):
            return _ref(["$defs", self.names[target], *(_tokens(ref) or [])[2:]])
        if isinstance(target, list):
            return _ref(self.at + target)
        return ref  # not local: left as it is


def merge_schemas(
    schemas: list[dict[str, Any]], place: list[list[str]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each schema ready to sit at ``place[i]`` (pointer tokens) of one document, and the
    ``$defs`` that document's root must carry. Identical definitions are shared."""
    tools = [_Tool(s, at, i) for i, (s, at) in enumerate(zip(schemas, place, strict=True))]
    meaning: dict[str, str] = {}  # merged name -> signature
    for tool in tools:
        for key in tool.defs:
            sign = tool.signature(key)
            name, n = key[1], 1
            while meaning.get(name, sign) != sign:
                n += 1
                name = f"{key[1]}_{n}"
            meaning[name] = sign
            tool.names[key] = name
    merged: dict[str, Any] = {}
    for tool in tools:
        for key, definition in tool.defs.items():
            merged.setdefault(tool.names[key], _rewritten(definition, tool.move))
    return [_rewritten(t.schema, t.move) for t in tools], merged
