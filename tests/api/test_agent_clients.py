"""Agent frameworks against real processes (Redis, a worker, the API): LangChain's ChatOpenAI,
the OpenAI Agents SDK and pydantic-ai, offline, with the API's key. The test model has
random weights, so its free text is noise: only structured output (a schema's grammar) and forced
tool calls give answers worth checking, and every one is validated against its schema."""

from __future__ import annotations

import asyncio
import json
from enum import StrEnum
from typing import Annotated, Literal

import httpx
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.models.openai import OpenAIResponsesModel as PydanticResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.api.conftest import TOOLS_KEY

API_KEY = TOOLS_KEY  # the shared stack's API asks for it
QUESTION = "What is the weather in Paris over the next three days?"


class Forecast(BaseModel):
    """A bounded schema: on random weights an unbounded string or integer may run to
    max_tokens."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=9)
    sky: Literal["sunny", "cloudy", "rain"]
    summary: str = Field(max_length=24)


class GetWeather(BaseModel):
    """The weather in a city over some days."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo", "Lima"]
    days: int = Field(ge=1, le=9)


class Sky(StrEnum):
    sunny = "sunny"
    cloudy = "cloudy"


class Place(BaseModel):
    city: Literal["Paris", "Oslo", "Lima"]
    district: str = Field(max_length=8)


class Report(BaseModel):
    """A sub-model and an enum: both are $defs in its JSON schema."""

    place: Place
    sky: Sky
    days: int = Field(ge=1, le=9)


# ---- the stack -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tools_stack) -> str:
    """The package's shared stack of the test model with a chat template that renders tools
    and their results."""
    return tools_stack.base


@pytest.fixture(scope="module")
def model(base) -> str:
    c = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    return c.models.list().data[0].id


# ---- LangChain ------------------------------------------------------------------------------
def chat_model(base: str, model: str, **kwargs) -> ChatOpenAI:
    return ChatOpenAI(
        model=model, base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120, **kwargs
    )


def test_langchain_structured_output_is_a_valid_instance(base, model):
    """`with_structured_output(Model)` sends a strict json_schema response_format and parses
    the answer into the model: on random weights only the grammar makes it parse."""
    llm = chat_model(base, model, max_completion_tokens=200)
    structured = llm.with_structured_output(Forecast, method="json_schema", include_raw=True)
    for question in (QUESTION, "And in Oslo?"):
        out = structured.invoke(question)
        assert out["parsing_error"] is None, out
        forecast = out["parsed"]
        assert isinstance(forecast, Forecast)
        assert Forecast.model_validate_json(out["raw"].content) == forecast


def test_langchain_bind_tools_any_returns_valid_tool_calls(base, model):
    """tool_choice "any" (OpenAI's "required") forces calls; each call's args validate. One
    call: with parallel calls allowed, random weights may go on calling until max_tokens cuts
    the last one."""
    llm = chat_model(base, model, max_completion_tokens=200)
    bound = llm.bind_tools([GetWeather], tool_choice="any", parallel_tool_calls=False)
    message = bound.invoke(QUESTION)
    assert isinstance(message, AIMessage)
    assert len(message.tool_calls) == 1, message
    assert not message.invalid_tool_calls, message.invalid_tool_calls
    for call in message.tool_calls:
        assert call["name"] == "GetWeather"
        GetWeather.model_validate(call["args"])
        assert call["id"]


# ---- OpenAI Agents SDK -----------------------------------------------------------------------
def run_forecaster(base: str, path: str, make_model, **agent_options):
    """Run an agent with one tool (get_weather) against llmq, recording every request its
    model sends to ``path``: (the run's result, the tool's calls, the request bodies)."""
    set_tracing_disabled(True)  # offline: nothing may be sent to OpenAI's trace exporter
    calls: list[tuple[str, int]] = []
    requests: list[dict] = []

    @function_tool
    def get_weather(
        city: Literal["Paris", "Oslo", "Lima"], days: Annotated[int, Field(ge=1, le=9)]
    ) -> str:
        """The weather in a city over some days."""
        calls.append((city, days))
        return f"sunny in {city} for {days} days"

    async def record(request: httpx.Request) -> None:
        if request.url.path.endswith(path):
            requests.append(json.loads(request.content))

    async def run():
        http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120)
        client = openai.AsyncOpenAI(
            base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, http_client=http
        )
        # Random weights call no tool of their own accord: the first turn is forced
        # ("required"), and reset_tool_choice (the default, said here) drops it after the call,
        # so the second turn, which sees the tool's result, may answer in text and the run
        # ends. One call per turn keeps the recorded calls countable; max_tokens leaves room
        # for the whole forced call (one cut short by max_tokens is no call at all).
        agent = Agent(
            name="forecaster",
            instructions="Answer with the weather.",
            tools=[get_weather],
            model=make_model(client),
            model_settings=ModelSettings(
                tool_choice="required", parallel_tool_calls=False, max_tokens=120
            ),
            reset_tool_choice=True,
            **agent_options,
        )
        try:
            return await Runner.run(agent, QUESTION, max_turns=3)
        finally:
            await http.aclose()

    return asyncio.run(run()), calls, requests


def test_openai_agents_calls_the_tool_and_feeds_its_result_back(base, model):
    result, calls, requests = run_forecaster(
        base,
        "/chat/completions",
        lambda client: OpenAIChatCompletionsModel(model=model, openai_client=client),
    )
    assert len(calls) == 1, calls
    city, days = calls[0]
    assert city in ("Paris", "Oslo", "Lima") and 1 <= days <= 9
    call_items = [i for i in result.new_items if isinstance(i, ToolCallItem)]
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert len(call_items) == 1 and len(outputs) == 1, result.new_items
    assert outputs[0].output == f"sunny in {city} for {days} days"

    # Two model calls: the forced one, then one that sees the tool's result as a tool message
    # answering the call the first one made.
    assert len(requests) == 2, requests
    assert requests[0]["tool_choice"] == "required"
    assert requests[1].get("tool_choice") in (None, "auto")
    assistant = next(m for m in requests[1]["messages"] if m.get("tool_calls"))
    tool = next(m for m in requests[1]["messages"] if m["role"] == "tool")
    assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"]
    assert tool["content"] == outputs[0].output
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {
        "city": city,
        "days": days,
    }
    assert isinstance(result.final_output, str)


def test_openai_agents_default_responses_model_runs_the_tool(base, model):
    """The Agents SDK's default model speaks the Responses API: a forced call, its result sent
    back as a function_call_output item, then the final output (text.format json_schema, its
    grammar ending it: an answer cut at max_output_tokens is a failed run for the SDK)."""
    result, calls, requests = run_forecaster(
        base,
        "/responses",
        lambda client: OpenAIResponsesModel(model=model, openai_client=client),
        output_type=Forecast,
    )
    assert len(calls) == 1, calls
    city, days = calls[0]
    outputs = [i for i in result.new_items if isinstance(i, ToolCallOutputItem)]
    assert len(outputs) == 1 and outputs[0].output == f"sunny in {city} for {days} days"
    assert len(requests) == 2, requests
    assert requests[0]["tool_choice"] == "required"
    assert requests[0]["tools"][0]["name"] == "get_weather"
    call = next(i for i in requests[1]["input"] if i.get("type") == "function_call")
    answer = next(i for i in requests[1]["input"] if i.get("type") == "function_call_output")
    assert answer["call_id"] == call["call_id"] and answer["output"] == outputs[0].output
    assert json.loads(call["arguments"]) == {"city": city, "days": days}
    assert requests[1]["text"]["format"]["type"] == "json_schema"
    assert isinstance(result.final_output, Forecast)


# ---- pydantic-ai ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model_class, path",
    [(OpenAIChatModel, "/chat/completions"), (PydanticResponsesModel, "/responses")],
    ids=["chat", "responses"],
)
def test_pydantic_ai_structured_output_through_its_output_tool(base, model, model_class, path):
    """pydantic-ai's default structured output is a tool the model must call ("required"),
    whose parameters are the output type's schema with its $defs."""
    requests: list[dict] = []

    async def record(request: httpx.Request) -> None:
        if request.url.path.endswith(path):
            requests.append(json.loads(request.content))

    async def run() -> Report:
        http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=120)
        client = openai.AsyncOpenAI(
            base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, http_client=http
        )
        provider = OpenAIProvider(openai_client=client)
        agent = PydanticAgent(
            model_class(model, provider=provider),
            output_type=Report,
            model_settings={"max_tokens": 150, "temperature": 0},
        )
        try:
            return (await agent.run(QUESTION)).output
        finally:
            await http.aclose()

    report = asyncio.run(run())
    assert isinstance(report, Report) and 1 <= report.days <= 9
    assert len(requests) == 1 and requests[0]["tool_choice"] == "required", requests
    tool = requests[0]["tools"][0]
    parameters = (tool.get("function") or tool)["parameters"]
    assert {"Place", "Sky"} <= set(parameters["$defs"])
