"""Request bodies of /v1/rerank (Jina's and Cohere's shape, as vLLM serves it) and /v1/score
(vLLM's), with the checks that name the field at fault."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from llmq.common.engine_client.text_input import check_text
from llmq.common.errors import InvalidRequest

MAX_DOCUMENTS = 1000  # documents (or pairs) per request: Cohere's bound

_TRUNCATE = (
    "Cut each pair (a query and a document) to this many tokens; -1 or unset: the model's "
    "limit. An embedding model cuts each text to it."
)


class RerankDocument(BaseModel):
    """A document given as an object (Cohere's and Jina's clients send ``{"text": ...}``)."""

    model_config = ConfigDict(extra="allow")

    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="Model to use; default: the one served.")
    query: str
    documents: list[str | RerankDocument]
    top_n: Annotated[int, Field(ge=0)] | None = Field(
        None, description="Answer the n best documents; 0 or unset: all of them."
    )
    return_documents: bool = Field(True, description="Give each result its document's text.")
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = Field(None, description=_TRUNCATE)

    def texts(self) -> list[str]:
        """The documents' texts, checked: a 400 naming the first one at fault."""
        if not self.documents:
            raise InvalidRequest("documents is an empty array", "documents")
        _check_count(len(self.documents), "documents")
        check_text(self.query, "query")
        if not self.query:
            raise InvalidRequest("query is an empty string", "query")
        texts = [d if isinstance(d, str) else d.text for d in self.documents]
        for i, text in enumerate(texts):
            check_text(text, f"documents[{i}]")
            if not text:
                raise InvalidRequest(f"documents[{i}] is an empty string", "documents")
        return texts


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="Model to use; default: the one served.")
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = Field(None, description=_TRUNCATE)

    def pairs(self) -> list[tuple[str, str]]:
        """The pairs to score, as vLLM pairs them: one text_1 with each text_2, or lists of
        equal length item by item."""
        first = [self.text_1] if isinstance(self.text_1, str) else list(self.text_1)
        second = [self.text_2] if isinstance(self.text_2, str) else list(self.text_2)
        for name, texts in (("text_1", first), ("text_2", second)):
            if not texts:
                raise InvalidRequest(f"{name} is an empty array", name)
            for i, text in enumerate(texts):
                where = name if isinstance(getattr(self, name), str) else f"{name}[{i}]"
                check_text(text, where)
                if not text:
                    raise InvalidRequest(f"{where} is an empty string", name)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise InvalidRequest(
                f"text_1 holds {len(first)} texts and text_2 {len(second)}: give one text_1, "
                "or as many as text_2 (they pair up in order)",
                "text_2",
            )
        _check_count(len(second), "text_2")
        return list(zip(first, second, strict=True))


def _check_count(n: int, param: str) -> None:
    if n > MAX_DOCUMENTS:
        raise InvalidRequest(f"{param} holds {n} items; at most {MAX_DOCUMENTS} per request", param)
