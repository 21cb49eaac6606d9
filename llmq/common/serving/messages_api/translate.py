"""A Messages request as the chat request that generates its answer, and the prompt's token
count (count_tokens) rendered exactly as that chat request renders it. What the model's chat
template can take decides two things: ``output_config.effort`` becomes ``reasoning_effort``
where the template has that variable and is otherwise accepted and not applied (Claude Code
sends it for every model; the answer's EFFORT_HEADER says so), and a system turn inside
``messages`` stands where it was sent where the template renders it there (else it joins the
system prompt)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from llmq.common.engine_client.pipeline import TokenGeneratorPipeline
from llmq.common.serving.chat_request import ChatCompletionRequest
from llmq.common.serving.messages_api.context_edits import (
    cleared,
    tool_clearing,
    trigger_tokens,
)
from llmq.common.serving.messages_api.conversation import chat_messages, is_prefill
from llmq.common.serving.messages_api.request import (
    EFFORTS,
    MessagesPrompt,
    MessagesRequest,
    ThinkingDisabled,
    ThinkingEnabled,
)
from llmq.common.serving.messages_api.tools import chat_tool_choice
from llmq.common.serving.reasoning import reasoning_template_kwargs
from llmq.common.serving.reasoning.template import KNOB
from llmq.common.validation import validation_error

log = logging.getLogger(__name__)

# The answer's header naming a requested effort the model's template cannot take.
EFFORT_HEADER = "llmq-effort-ignored"
_MID_SYSTEM_PROBE = "llmq-mid-system-probe"
_ANSWER_PROBE = "llmq-answer-probe"
_mid_system: dict[str, bool] = {}  # template source -> renders a system turn mid-conversation


@dataclass(frozen=True)
class Template:
    """What the model's chat template takes: a reasoning effort, a system turn anywhere."""

    effort: bool = False
    mid_system: bool = True

    @classmethod
    def of(cls, tokenizer) -> Template:
        source = getattr(tokenizer, "chat_template", None)
        if not isinstance(source, str):
            return cls()
        if source not in _mid_system:
            _mid_system[source] = _renders_mid_system(tokenizer)
        return cls(effort=KNOB in source, mid_system=_mid_system[source])


def _renders_mid_system(tokenizer) -> bool:
    """Whether the template renders a system message after other turns, where it stands
    (templates that take one only first raise, or move it)."""
    probe = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": _ANSWER_PROBE},
        {"role": "system", "content": _MID_SYSTEM_PROBE},
        {"role": "user", "content": "v"},
    ]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that refuses it (raise_exception)
        return False
    return isinstance(text, str) and -1 < text.find(_ANSWER_PROBE) < text.find(_MID_SYSTEM_PROBE)


def ignored_effort(body: MessagesPrompt, template: Template) -> str | None:
    """The requested effort the template cannot take (then not applied), or None."""
    return None if template.effort else body.effort()


def _prompt_fields(body: MessagesPrompt, template: Template) -> dict[str, Any]:
    """The chat fields that render the prompt (messages, tools, template variables)."""
    messages = chat_messages(body, template.mid_system)
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if is_prefill(body):  # the answer continues the last assistant turn, as Anthropic's
        fields |= {"add_generation_prompt": False, "continue_final_message": True}
    if body.tools:
        fields["tools"] = [t.chat_tool() for t in body.tools]
        choice = body.tool_choice
        if choice is not None:
            fields["tool_choice"] = chat_tool_choice(choice)
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if body.thinking is not None:
        # Templates with the knob (Qwen3's) think or not as asked; others ignore it.
        thinks = not isinstance(body.thinking, ThinkingDisabled)
        fields["chat_template_kwargs"] = {"enable_thinking": thinks}
        display = getattr(body.thinking, "display", None)
        fields["include_reasoning"] = thinks and display != "omitted"
        if isinstance(body.thinking, ThinkingEnabled):
            fields["thinking_budget"] = body.thinking.budget_tokens
    if (effort := body.effort()) is not None and template.effort:
        fields["reasoning_effort"] = EFFORTS[effort]
    return fields


def _answer_fields(body: MessagesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"max_tokens": body.max_tokens, "stream": body.stream}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    optional = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "stop": body.stop_sequences,
        "user": body.user(),
        "speculative": body.speculative,
    }
    fields |= {k: v for k, v in optional.items() if v is not None}
    config = body.output_config
    # A forced call is the constrained output of its turn: the format is for a text answer,
    # which a forced turn does not give (chat refuses the two together).
    if config is not None and config.format is not None and not body.forced_call():
        schema = {"name": "output", "schema": config.format.json_schema, "strict": True}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    return fields


def chat_request(body: MessagesPrompt, template: Template) -> ChatCompletionRequest:
    """The chat request of ``body`` (a count_tokens body: its prompt alone)."""
    fields = _prompt_fields(body, template)
    if isinstance(body, MessagesRequest):
        fields |= _answer_fields(body)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


async def prompt_tokens(pipeline: TokenGeneratorPipeline, body: MessagesPrompt) -> int:
    """The prompt's token count, rendered as the chat generation of ``body`` renders it."""
    chat = chat_request(body, Template.of(pipeline.tokenizer))
    template = getattr(pipeline.tokenizer, "chat_template", None)
    effort = reasoning_template_kwargs(chat.reasoning_effort, template)
    ids = await pipeline.encode_chat(
        chat.template_messages(),
        tools=chat.template_tools(),
        **{**chat.template_kwargs(), **effort},
    )
    return len(ids)


async def edited(pipeline: TokenGeneratorPipeline, body: MessagesPrompt) -> MessagesPrompt:
    """``body`` with its context_management edits applied: tool results cleared once the
    prompt, rendered whole, passes the edit's trigger."""
    edit = tool_clearing(body)
    if edit is None or await prompt_tokens(pipeline, body) <= trigger_tokens(edit):
        return body
    body, count = cleared(body, edit)
    log.info("context_management: cleared %d tool uses", count)
    return body
