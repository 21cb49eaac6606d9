"""A Responses conversation (input items, earlier outputs) as chat messages: messages with text
parts, ``function_call`` items as an assistant turn's tool calls, ``function_call_output`` items
as tool messages answering them."""

from __future__ import annotations

from typing import Any

from llmq.common.errors import InvalidRequest

# Content parts read as text; input_image becomes an image part; others (files, audio) are
# refused.
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's ``input`` as items (a string: one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return value


def _text(content: Any, param: str) -> str:
    parts = _parts(content, param, images=False)
    return parts if isinstance(parts, str) else "".join(p["text"] for p in parts)


def _parts(content: Any, param: str, images: bool = True) -> str | list[dict[str, Any]]:
    """The content as text, or (with an ``input_image``) as chat content parts in order."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{param} must be a string or an array of content parts", param)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if images and kind == "input_image":
            parts.append(_image(part, f"{param}[{i}]"))
        elif kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            served = "text and input_image" if images else "text"
            raise InvalidRequest(
                f"{param}[{i}]: only {served} content parts are served (type {kind!r})",
                f"{param}[{i}]",
            )
        else:
            parts.append({"type": "text", "text": part["text"]})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``input_image`` as chat's image_url part (a file_id is not served: no Files images)."""
    url = part.get("image_url")
    if not isinstance(url, str):
        raise InvalidRequest(
            f"{where}: an input_image needs image_url (file_id is not served)", where
        )
    return {"type": "image_url", "image_url": {"url": url, "detail": part.get("detail")}}


def _string(item: dict, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{param}.{key} must be a string", f"{param}.{key}")
    return value


def _call(item: dict, param: str) -> dict[str, Any]:
    function = {
        "name": _string(item, "name", param),
        "arguments": _string(item, "arguments", param),
    }
    return {"id": _string(item, "call_id", param), "type": "function", "function": function}


def chat_messages(items: list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """The chat messages of ``items``; calls following an assistant message (or each other)
    join that assistant turn."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidRequest(f"{where}.role must be one of {', '.join(_ROLES)}", where)
            content = _parts(item.get("content"), f"{where}.content")
            messages.append({"role": role, "content": content})
        elif kind == "function_call":
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(_call(item, where))
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            call_id = _string(item, "call_id", where)
            messages.append({"role": "tool", "content": output, "tool_call_id": call_id})
        elif kind == "reasoning":
            continue  # a model's reasoning of an earlier turn: not part of the prompt
        else:
            raise InvalidRequest(f"{where}: input items of type {kind!r} are not served", where)
    return messages
