"""Tool calls in generated text, per model family's format (Hermes, Llama 3 JSON, Mistral) and
for the JSON array a ``tool_choice: "required"`` grammar forces."""

from llmq.common.serving.tool_parsers.formats import (
    FORCED_ARRAY,
    FORMATS,
    PARSER_NAMES,
    ToolCallFormat,
    choose_format,
    format_for_template,
)
from llmq.common.serving.tool_parsers.parser import (
    ArgumentsText,
    CallOpened,
    ContentText,
    Event,
    ParsedOutput,
    ToolCallParser,
    collect,
    output_events,
    parse_output,
)

__all__ = [
    "FORCED_ARRAY",
    "FORMATS",
    "PARSER_NAMES",
    "ArgumentsText",
    "CallOpened",
    "ContentText",
    "Event",
    "ParsedOutput",
    "ToolCallFormat",
    "ToolCallParser",
    "choose_format",
    "collect",
    "format_for_template",
    "output_events",
    "parse_output",
]
