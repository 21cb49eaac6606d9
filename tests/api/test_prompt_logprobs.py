"""Prompt logprobs through real processes (redis-server, `llmq worker`, `llmq api`): echo with
logprobs and max_tokens 0 as evaluation harnesses send them, vLLM's prompt_logprobs on
completions and chat, streamed echo, and each prompt token's logprob equal to transformers'
``model(input_ids).logits.log_softmax(-1)`` in float32."""

from __future__ import annotations

import json

import httpx
import pytest
import redis
import torch

from llmq.common.model_files import load_tokenizer
from llmq.common.serving.logprobs import token_text
from llmq.common.transport import Keys
from llmq.worker.loading.model_loader import load_causal_lm
from tests.api.api_stack import MESSAGES, PROMPT, PROMPT2, assert_error

TOL = 1e-4


@pytest.fixture(scope="module")
def served(main):
    """The package's shared stack of the test model."""
    return main


@pytest.fixture(scope="module")
def hf(llama_dir):
    return load_causal_lm(str(llama_dir), "float32", "cpu"), load_tokenizer(str(llama_dir))


def log_softmax(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def post(served, path: str, body: dict) -> dict:
    r = httpx.post(f"{served.base}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_are_the_models_token_for_token(served, hf):
    """lm-eval's loglikelihood request: token ids, max_tokens 1, logprobs 1, echo."""
    model, tok = hf
    prompts = [tok.encode(PROMPT), tok.encode(PROMPT2)]
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 3, "echo": True, "temperature": 0}
    out = post(served, "/v1/completions", body)
    for choice, ids in zip(out["choices"], prompts, strict=True):
        lp = choice["logprobs"]
        logp = log_softmax(model, ids)
        assert len(lp["tokens"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            row = logp[i - 1]
            assert abs(lp["token_logprobs"][i] - row[ids[i]].item()) < TOL
            vals, top_ids = row.topk(3)
            want = {
                token_text(tok, t): v for t, v in zip(top_ids.tolist(), vals.tolist(), strict=True)
            }
            got = lp["top_logprobs"][i]
            assert got.keys() == want.keys()
            assert all(abs(got[k] - want[k]) < TOL for k in want)
        # The generated token: the greedy one, with its logprob.
        best = int(logp[-1].argmax())
        assert lp["tokens"][-1] == token_text(tok, best)
        assert abs(lp["token_logprobs"][-1] - logp[-1, best].item()) < TOL
        # Echo: the text is the prompt's and the generated token's; offsets index into it.
        prompt_text = tok.decode(ids, skip_special_tokens=True)
        assert choice["text"].startswith(prompt_text)
        offsets = lp["text_offset"]
        for i, t in enumerate(lp["tokens"][:-1]):
            assert choice["text"][offsets[i] : offsets[i] + len(t)] == t
        assert offsets[-1] == len(prompt_text)
    assert out["usage"]["completion_tokens"] == 2


def test_max_tokens_0_answers_the_prompt_alone(served, hf):
    model, tok = hf
    ids = tok.encode(PROMPT)
    body = {"prompt": ids, "max_tokens": 0, "logprobs": 0, "echo": True, "temperature": 0}
    out = post(served, "/v1/completions", body)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == tok.decode(ids, skip_special_tokens=True)
    assert out["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
    }
    logp = log_softmax(model, ids)
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == len(ids) and lps[0] is None
    assert max(abs(lps[i] - logp[i - 1, ids[i]].item()) for i in range(1, len(ids))) < TOL
    assert choice["logprobs"]["top_logprobs"][1:] == [{}] * (len(ids) - 1)
    # Recorded with the request, for a client that missed the message.
    r = redis.Redis.from_url(served.redis_url)
    recorded = [
        json.loads(v)
        for key in r.scan_iter(Keys().req("*"), _type="hash")
        if (v := r.hget(key, "prompt_logprobs")) is not None
    ]
    assert any([e and e["logprob"] for e in rec] == [None, *lps[1:]] for rec in recorded)


def test_streamed_echo_equals_the_whole_answer(served):
    body = {"prompt": PROMPT, "max_tokens": 5, "logprobs": 2, "echo": True, "temperature": 0}
    whole = post(served, "/v1/completions", body)["choices"][0]
    text, tokens, lps, tops, offsets = "", [], [], [], []
    with httpx.stream(
        "POST", f"{served.base}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            if choice["logprobs"]:
                tokens += choice["logprobs"]["tokens"]
                lps += choice["logprobs"]["token_logprobs"]
                tops += choice["logprobs"]["top_logprobs"]
                offsets += choice["logprobs"]["text_offset"]
    assert text == whole["text"]
    w = whole["logprobs"]
    assert tokens == w["tokens"] and offsets == w["text_offset"]
    assert lps[0] is None and tops[0] is None
    assert max(abs(a - b) for a, b in zip(lps[1:], w["token_logprobs"][1:], strict=True)) < TOL


def check_vllm_entries(entries: list, ids: list[int], logp: torch.Tensor, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        row, entry = logp[i - 1], entries[i]
        mine = entry[str(ids[i])]
        assert abs(mine["logprob"] - row[ids[i]].item()) < TOL
        assert mine["rank"] == int((row > row[ids[i]]).sum()) + 1
        for rank, t in enumerate(row.topk(k).indices.tolist(), start=1):
            assert entry[str(t)]["rank"] == rank or t == ids[i]
        assert len(entry) in (k, k + 1)


def test_vllm_prompt_logprobs_on_completions_and_chat(served, hf):
    model, tok = hf
    ids = tok.encode(PROMPT2)
    body = {"prompt": PROMPT2, "max_tokens": 2, "prompt_logprobs": 2}
    for choice in post(served, "/v1/completions", {**body, "n": 2})["choices"]:
        check_vllm_entries(choice["prompt_logprobs"], ids, log_softmax(model, ids), 2)
        assert choice["logprobs"] is None
    streamed = []
    with httpx.stream(
        "POST", f"{served.base}/v1/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        streamed = [
            c["choices"][0].get("prompt_logprobs")
            for line in r.iter_lines()
            if line.startswith("data: {") and (c := json.loads(line[6:]))["choices"]
        ]
    assert streamed[0] is not None and streamed[1:] == [None] * (len(streamed) - 1)
    check_vllm_entries(streamed[0], ids, log_softmax(model, ids), 2)

    chat_ids = tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    out = post(
        served,
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 1, "prompt_logprobs": 1},
    )
    check_vllm_entries(
        out["prompt_logprobs"], list(chat_ids), log_softmax(model, list(chat_ids)), 1
    )
    plain = post(served, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert "prompt_logprobs" not in plain and "prompt_logprobs" not in plain["choices"][0]
    chat = f"{served.base}/v1/chat/completions"
    body = {"messages": MESSAGES, "prompt_logprobs": 1, "stream": True}
    assert_error(httpx.post(chat, json=body), 400, param="prompt_logprobs")
    for bad in (-1, 21):
        body = {"prompt": "x", "prompt_logprobs": bad}
        assert_error(
            httpx.post(f"{served.base}/v1/completions", json=body), 400, param="prompt_logprobs"
        )
    body = {"messages": MESSAGES, "max_tokens": 0}
    assert_error(httpx.post(chat, json=body), 400, param="max_tokens")
