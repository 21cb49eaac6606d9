"""Cross-encoders: sequence-classification checkpoints with one label (BERT, XLM-RoBERTa,
ModernBERT rerankers and the like) that score a (query, document) pair read together. Told
from config.json; the score is the logit through the model's activation, as
sentence-transformers' CrossEncoder and vLLM give it (sigmoid unless the checkpoint names
another)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from llmq.common.model_files import model_file
from llmq.worker.loading.model_loader import load_float32_auto

# Position ids of these start after the padding index: two fewer positions than the table has.
_OFFSET_POSITIONS = {"roberta", "xlm-roberta", "camembert", "xlm-roberta-xl"}
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity"}


@dataclass(slots=True, frozen=True)
class CrossEncoderConfig:
    activation: str  # "sigmoid" or "identity": what turns the logit into the score
    max_length: int | None  # the positions the model has (None: the config does not say)


def _activation(config: dict) -> str:
    """sentence-transformers' choice: the checkpoint's ``activation_fn`` (``sbert_ce_default_
    activation_function`` before its v4), else sigmoid for one label."""
    st = config.get("sentence_transformers")
    name = (st.get("activation_fn") if isinstance(st, dict) else None) or config.get(
        "sbert_ce_default_activation_function"
    )
    if not name:
        return "sigmoid"
    short = str(name).rsplit(".", 1)[-1]
    if short not in _ACTIVATIONS:
        raise ValueError(
            f"the cross-encoder's activation {name!r} is not supported (Sigmoid, Identity)"
        )
    return _ACTIVATIONS[short]


def cross_encoder_config(model: str) -> CrossEncoderConfig | None:
    """How to score with ``model`` when it is a sequence-classification checkpoint; None for
    any other model. ValueError for a classifier of more than one label (not a cross-encoder)."""
    path = model_file(model, "config.json")
    if path is None:
        return None
    with open(path) as f:
        config = json.load(f)
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return None
    labels = len(config.get("id2label") or {}) or config.get("num_labels") or 2
    if labels != 1:
        raise ValueError(
            f"{model} is a classifier with {labels} labels; llmq serves cross-encoders "
            "(sequence classification with one label) for /v1/rerank and /v1/score"
        )
    positions = config.get("max_position_embeddings")
    if positions and config.get("model_type") in _OFFSET_POSITIONS:
        positions -= (config.get("pad_token_id") or 1) + 1
    return CrossEncoderConfig(_activation(config), positions or None)


def load_cross_encoder(model: str, dtype: str = "auto", device: str = "auto"):
    """The classifier. auto dtype is float32: rankings turn on small score differences."""
    from transformers import AutoModelForSequenceClassification

    return load_float32_auto(
        AutoModelForSequenceClassification, "cross-encoder", model, dtype, device
    )
