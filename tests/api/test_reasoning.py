"""Reasoning apart from the answer, end to end: the openai client against a real API and worker
on a random model made a reasoning model (its template opens <think> in the prompt). A grammar
makes the output a few letters, the </think> token, a few letters: greedy, where the block
closes is known from the logprobs' tokens, the reference for what each part must hold."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import jsonschema
import openai
import pytest

from llmq.common.transport.redis_server import RedisServer
from tests.harness import kill_all, start_api, start_worker, wait_worker
from tests.reasoning_model import as_reasoning_model

MESSAGES = [{"role": "user", "content": "What is two plus two?"}]
END = "</think>"


@dataclass(frozen=True)
class Served:
    url: str
    model: str
    end_id: int  # the </think> token

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=120)

    def create(self, **kwargs):
        return self.client().chat.completions.create(model=self.model, **kwargs)

    def closing_body(self) -> dict:
        """Greedy, 3 to 6 letters, </think>, 3 to 6 letters, with each token's logprob."""
        grammar = f"start: /[a-z]{{3,6}}/ <[{self.end_id}]> /[a-z]{{3,6}}/"
        return dict(
            messages=MESSAGES,
            temperature=0,
            max_tokens=40,
            logprobs=True,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )


@pytest.fixture(scope="module")
def served(llama_dir, tmp_path_factory) -> Served:
    from transformers import AutoTokenizer

    model = as_reasoning_model(llama_dir, tmp_path_factory.mktemp("reasoning-model") / "llama")
    (end_id,) = AutoTokenizer.from_pretrained(model).encode(END, add_special_tokens=False)
    logs = tmp_path_factory.mktemp("reasoning-logs")
    with RedisServer() as server:
        worker = start_worker(server.url, model, "w-reasoning", logs, wait=False)
        api, url = start_api(server.url, model, logs, "api-reasoning")
        try:
            wait_worker(server.url, "w-reasoning", worker)
            yield Served(url, str(model), end_id)
        finally:
            kill_all([api, worker])


def reference(logprobs) -> tuple[str, str, int]:
    """The reasoning (tokens before </think>), content (after) and reasoning tokens."""
    tokens = [t.token for t in logprobs.content]
    at = tokens.index(END)
    return "".join(tokens[:at]), "".join(tokens[at + 1 :]), at + 1


def test_reasoning_apart_from_content(served):
    r = served.create(**served.closing_body())
    message = r.choices[0].message
    reasoning, content, count = reference(r.choices[0].logprobs)
    assert len(reasoning) >= 3 and len(content) >= 3
    assert message.content == content
    assert message.model_extra["reasoning_content"] == reasoning
    assert message.model_extra["reasoning"] == reasoning
    assert r.usage.completion_tokens_details.reasoning_tokens == count
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.content)


def test_streamed_reasoning_then_content(served):
    whole = served.create(**served.closing_body())
    reasoning, content, count = reference(whole.choices[0].logprobs)
    chunks = list(
        served.create(stream=True, stream_options={"include_usage": True}, **served.closing_body())
    )
    parts, order = {"reasoning": "", "content": ""}, []
    for chunk in chunks:
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")
            if extra.get("reasoning_content"):
                parts["reasoning"] += extra["reasoning_content"]
                order.append("reasoning")
            if c.delta.content:
                parts["content"] += c.delta.content
                order.append("content")
    assert parts == {"reasoning": reasoning, "content": content}
    assert order == sorted(order, key=["reasoning", "content"].index)  # thinking first
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == count


def test_include_reasoning_false_leaves_it_out(served):
    body = served.closing_body()
    body["extra_body"] = {**body["extra_body"], "include_reasoning": False}
    r = served.create(**body)
    _, content, count = reference(r.choices[0].logprobs)
    assert r.choices[0].message.content == content
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    assert r.usage.completion_tokens_details.reasoning_tokens == count


def test_chat_template_kwargs_reach_the_template(served):
    """enable_thinking false: the template closes an empty block in the prompt (4 tokens
    more), and the output is all content, </think> included."""
    on = served.create(**served.closing_body())
    body = served.closing_body()
    body["extra_body"] = {**body["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}
    off = served.create(**body)
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    tokens = [t.token for t in off.choices[0].logprobs.content]
    assert END in tokens
    assert off.choices[0].message.content == "".join(tokens)
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_reasoning_effort_passed_to_a_template_that_reads_it(served):
    plain = served.create(messages=MESSAGES, max_tokens=1)
    high = served.create(messages=MESSAGES, max_tokens=1, reasoning_effort="high")
    assert high.usage.prompt_tokens > plain.usage.prompt_tokens


SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": [1, 2]}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
N = 6


def thinking_body(served: Served, **fields) -> dict:
    """Sampled (seeded) with </think> made likely: each choice thinks a few tokens, some none,
    then gives its answer under the grammar."""
    return dict(
        messages=MESSAGES,
        n=N,
        temperature=1.0,
        seed=11,
        max_tokens=60,
        logprobs=True,
        logit_bias={str(served.end_id): 6},
        **fields,
    )


def split_tokens(choice) -> tuple[int, str]:
    """The reasoning tokens (</think> included) and the text after </think> of a choice."""
    tokens = [t.token for t in choice.logprobs.content]
    at = tokens.index(END)
    return at + 1, "".join(tokens[at + 1 :])


def streamed_parts(chunks) -> dict[int, dict[str, str]]:
    parts: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            part = parts.setdefault(c.index, {"reasoning": "", "content": ""})
            part["reasoning"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
            part["content"] += c.delta.content or ""
    return parts


def test_json_answer_follows_the_thinking(served):
    """response_format json_schema on a prompt that opened the think block: the grammar holds
    from </think> on, the thinking is reasoning_content, the content valid JSON."""
    fmt = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA}}
    r = served.create(**thinking_body(served, response_format=fmt))
    thought = 0
    for choice in r.choices:
        count, after = split_tokens(choice)
        assert choice.finish_reason == "stop"
        assert choice.message.content == after
        jsonschema.validate(json.loads(after), SCHEMA)
        reasoning = (choice.message.model_extra or {}).get("reasoning_content")
        assert (reasoning is not None) == (count > 1), (count, reasoning)
        thought += count > 1
    assert thought > 0
    total = sum(split_tokens(c)[0] for c in r.choices)
    assert r.usage.completion_tokens_details.reasoning_tokens == total
    chunks = served.create(stream=True, **thinking_body(served, response_format=fmt))
    parts = streamed_parts(chunks)
    for choice in r.choices:
        reasoning = (choice.message.model_extra or {}).get("reasoning_content") or ""
        assert parts[choice.index] == {"reasoning": reasoning, "content": choice.message.content}


def test_forced_tool_call_follows_the_thinking(served):
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    named = {"type": "function", "function": {"name": "f"}}
    r = served.create(**thinking_body(served, tools=[tool], tool_choice=named))
    thought = 0
    for choice in r.choices:
        count, after = split_tokens(choice)
        (call,) = choice.message.tool_calls
        assert call.function.name == "f"
        assert call.function.arguments == after
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
        thought += bool((choice.message.model_extra or {}).get("reasoning_content"))
    assert thought > 0


def test_template_call_arguments_refused_in_chat_template_kwargs(served):
    body = {"model": served.model, "messages": MESSAGES, "max_tokens": 1}
    body["chat_template_kwargs"] = {"tokenize": False}
    r = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "tokenize" in r.json()["error"]["message"]
    assert r.json()["error"]["param"].startswith("chat_template_kwargs")


def test_a_thinking_budget_closes_the_block_in_time(served):
    """thinking_budget (Anthropic's thinking.budget_tokens onto chat): the thinking closes at
    the budget where the same greedy thinking alone goes on past it."""
    body = dict(messages=MESSAGES, temperature=0, max_tokens=24, logprobs=True)
    free = served.create(**body)
    assert END not in [t.token for t in free.choices[0].logprobs.content][:9]
    bounded = served.create(**body, extra_body={"thinking_budget": 8})
    tokens = [t.token for t in bounded.choices[0].logprobs.content]
    assert tokens.index(END) == 8, tokens
    assert bounded.usage.completion_tokens_details.reasoning_tokens == 9
    message = bounded.choices[0].message
    assert message.model_extra["reasoning_content"] and message.content is not None
