"""Request bodies of the OpenAI-compatible endpoints (pydantic): the HTTP routes and batch lines
validate with them."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator
from pydantic.json_schema import SkipJsonSchema

from llmq.common.sampling_params import SamplingParams
from llmq.common.serving.structured_output import (
    Choices,
    JsonSchemaSource,
    ResponseFormat,
    StructuredOutputs,
    build_grammar,
    grammar_for,
    requested_constraint,
)

MAX_N = 8
MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # bounds one row's work per step
MAX_INPUTS = 2048  # embedding inputs per request
MAX_PROMPTS = 2048  # completion prompts per request (each one queue entry per choice)
# vLLM options this server does not implement, each with the values that ask for what it
# does anyway (accepted); any other value is refused, never ignored.
UNSERVED_DEFAULTS: dict[str, tuple] = {
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "early_stopping": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "detokenize": (True,),
    "logits_processors": ([],),
    "guided_whitespace_pattern": (),
    "return_token_ids": (False,),
    "chat_template": (),
    "documents": (),
}


def refuse(value, what: str):
    """Refused, not ignored: a caller relying on ``what`` must not get an answer without it."""
    if value:
        raise ValueError(f"{what} is not supported by this server")
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What chat and completions share. Unknown fields are accepted and ignored, as OpenAI-style
    clients (LangChain and others) send extras."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="Model to use; default: the one served.")
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    seed: Annotated[int, Field(ge=-(2**63), lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None,
        description="Token id (as a string) -> bias in [-100, 100] added to its logit before "
        "sampling; -100 bans a token, 100 all but forces it.",
    )
    # vLLM's options (documented in docs/api/chat.md), out of the OpenAPI schema: a generated
    # request of OpenAI's fields should not trip over their cross-field rules.
    include_stop_str_in_output: SkipJsonSchema[bool] = Field(
        False, description="End the text with the stop string that stopped it (vLLM's option)."
    )
    truncate_prompt_tokens: SkipJsonSchema[Annotated[int, Field(ge=-1)] | None] = Field(
        None,
        description="Keep only the prompt's last k tokens; -1: as many as leave room for "
        "max_tokens in the context.",
    )
    speculative: SkipJsonSchema[bool] = Field(
        True,
        description="False: no speculative decoding for this request, where the worker runs "
        "it (llmq's option; the output is the same either way).",
    )
    # Structured output (structured_output.py): at most one of these; out of the OpenAPI schema,
    # as vLLM's options, so that a generated request does not trip over their rules.
    response_format: SkipJsonSchema[ResponseFormat | None] = None
    structured_outputs: SkipJsonSchema[StructuredOutputs | None] = None
    guided_json: SkipJsonSchema[JsonSchemaSource | None] = None
    guided_regex: SkipJsonSchema[str | None] = None
    guided_choice: SkipJsonSchema[Choices | None] = None
    guided_grammar: SkipJsonSchema[str | None] = None
    # vLLM options that change what is generated and that this server does not serve: refused,
    # not ignored (and left out of the OpenAPI schema).
    allowed_token_ids: SkipJsonSchema[Any] = None
    bad_words: SkipJsonSchema[Any] = None
    use_beam_search: SkipJsonSchema[Any] = None
    length_penalty: SkipJsonSchema[Any] = None
    early_stopping: SkipJsonSchema[Any] = None
    skip_special_tokens: SkipJsonSchema[Any] = None
    spaces_between_special_tokens: SkipJsonSchema[Any] = None
    detokenize: SkipJsonSchema[Any] = None
    logits_processors: SkipJsonSchema[Any] = None
    guided_whitespace_pattern: SkipJsonSchema[Any] = None
    return_token_ids: SkipJsonSchema[Any] = None
    chat_template: SkipJsonSchema[Any] = None
    documents: SkipJsonSchema[Any] = None
    # vLLM's prompt logprobs: each prompt token's logprob, rank and the top k, answered as
    # vLLM does (per choice on completions, at the top level on chat).
    prompt_logprobs: SkipJsonSchema[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None] = None

    # Refused unless it equals n (left out of the OpenAPI schema): every choice is returned.
    best_of: SkipJsonSchema[int | None] = None

    # The grammar of the structured output asked for, once built (prepare_grammar).
    _grammar: str | None = PrivateAttr(None)
    _grammar_built: bool = PrivateAttr(False)

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v, info: ValidationInfo):
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of is not supported (every choice is returned: use n)")
        return v

    @field_validator("allowed_token_ids", "bad_words", *UNSERVED_DEFAULTS)
    @classmethod
    def _unserved(cls, v, info: ValidationInfo):
        if v is not None and v not in UNSERVED_DEFAULTS.get(info.field_name, ()):
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v):
        if v == 0:
            raise ValueError("truncate_prompt_tokens must be positive (or -1)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v and len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries")
        for key in v or {}:
            # Ten digits at most: a token id is far below 10**10, and int() of a string of
            # over 4300 digits raises (a 5000-digit key answered a 500).
            if not key.isascii() or not key.isdigit() or len(key) > 10:
                raise ValueError(f"logit_bias keys must be token ids, not {key[:32]!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        return v

    @field_validator("prompt_logprobs")
    @classmethod
    def _streamed_prompt_logprobs(cls, v, info: ValidationInfo):
        if v is not None and info.data.get("stream") and not cls.streams_prompt_logprobs:
            raise ValueError("prompt_logprobs is not supported with stream on this endpoint")
        return v

    # Whether a streamed answer carries prompt logprobs (completions' first chunk of a choice).
    streams_prompt_logprobs: ClassVar[bool] = False

    def wanted_prompt_logprobs(self) -> int | None:
        """The top k of the prompt logprobs the engine computes (None: none)."""
        return self.prompt_logprobs

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    async def prepare_grammar(self) -> None:
        """Build and validate the structured output's grammar (a 400 if it is invalid), in a
        thread if it is large; call it before submitting anything."""
        if not self._grammar_built:
            self._grammar = await grammar_for(self)
            self._grammar_built = True

    def grammar(self) -> str | None:
        """The structured output's grammar (None: free text); built here, on the event loop,
        if ``prepare_grammar`` was not awaited."""
        if not self._grammar_built:
            constraint = requested_constraint(self)
            self._grammar = build_grammar(constraint) if constraint else None
            self._grammar_built = True
        return self._grammar

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            grammar=self.grammar(),
            prompt_logprobs=self.wanted_prompt_logprobs(),
            speculative=self.speculative,
        )


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    # 0: the prompt alone (with echo and logprobs: its logprobs, as evaluation harnesses ask).
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    return_tokens_as_token_ids: SkipJsonSchema[bool] = Field(
        False, description="Logprobs' tokens as 'token_id:{id}' (vLLM's option)."
    )
    streams_prompt_logprobs: ClassVar[bool] = True
    # Refused unless it asks for nothing (left out of the OpenAPI schema, like chat's).
    suffix: SkipJsonSchema[str | None] = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        return refuse(v, "suffix (insertion)")

    @field_validator("prompt")
    @classmethod
    def _prompt_count(cls, v):
        if isinstance(v, list) and v and not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return v

    def max_tokens_field(self) -> str:
        return "max_tokens"

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens if "max_tokens" in self.model_fields_set else 16

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def wanted_prompt_logprobs(self) -> int | None:
        """echo with logprobs k answers the prompt's logprobs too, with their top k."""
        wanted = [k for k in (self.prompt_logprobs, self.echo_logprobs()) if k is not None]
        return max(wanted) if wanted else None

    def echo_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    # A string, a list of strings, a list of token ids or a list of lists of token ids; checked
    # when embedding, so that a wrong shape gets a message that says what is accepted.
    input: Any
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    # vLLM's extension: cut inputs to this many tokens (-1: the model's limit) instead of a 400.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
