"""The tool-call formats of model families: what opens the part of the output that holds calls,
and which key holds a call's arguments."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """Calls are JSON objects ``{"name": ..., <args key>: {...}}`` after an opening marker;
    what lies between the objects (closing tags, commas, brackets, semicolons) is skipped."""

    name: str
    markers: tuple[str, ...]
    # Calls only at the very start of the output (after whitespace); anything else is text.
    at_start_only: bool = False
    # The marker is the call's own first character (Llama 3's bare "{"): not consumed.
    keep_markers: tuple[str, ...] = ()
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    # The output is calls from its first character (a grammar forced them).
    starts_with_calls: bool = False


# Qwen2.5/3, SmolLM3, Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated.
HERMES = ToolCallFormat("hermes", ("<tool_call>",))
# Llama 3.1/3.2: {"name": ..., "parameters": {...}}, optionally after <|python_tag|>, calls
# separated by ";".
LLAMA3_JSON = ToolCallFormat(
    "llama3_json", ("<|python_tag|>", "{"), at_start_only=True, keep_markers=("{",)
)
# Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
MISTRAL = ToolCallFormat("mistral", ("[TOOL_CALLS]",))
# tool_choice "required": the grammar's JSON array [{"name": ..., "parameters": {...}}, ...].
FORCED_ARRAY = ToolCallFormat("required", (), args_keys=("parameters",), starts_with_calls=True)

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
PARSER_NAMES = tuple(FORMATS)

# What in a chat template's text tells its model's format, checked in this order.
_TEMPLATE_SIGNS: tuple[tuple[str, ToolCallFormat], ...] = (
    ("<tool_call>", HERMES),
    ("[TOOL_CALLS]", MISTRAL),
    ("<|python_tag|>", LLAMA3_JSON),
)


def format_for_template(template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template's text names, or None when it cannot be told."""
    for sign, fmt in _TEMPLATE_SIGNS:
        if template and sign in template:
            return fmt
    return None


def choose_format(configured: str | None, template: str | None) -> ToolCallFormat | None:
    """The configured parser (LLMQ_TOOL_PARSER) when set, else the one the template names."""
    if configured:
        return FORMATS[configured]
    return format_for_template(template)
