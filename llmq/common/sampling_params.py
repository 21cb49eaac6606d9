"""Per-request sampling parameters, shared by the API, the wire format and the sampler."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

GREEDY_BELOW = 1e-5  # temperatures under this are greedy


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the top k
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # None: no prompt logprobs; k: each prompt token's logprob, its rank and the top k (the
    # prompt rows' logits are then kept, and the prefix cache is not used for the prompt).
    prompt_logprobs: int | None = None
    # Constrained decoding: an llguidance grammar (the JSON text LLMatcher.grammar_from_*
    # returns), built and validated by the API; None: unconstrained.
    grammar: str | None = None
    # False: no speculative decoding for this request (the worker's proposer skips it).
    speculative: bool = True

    @property
    def greedy(self) -> bool:
        # Below 1e-5 (as vLLM): logits divided by such a temperature overflow to inf and NaN,
        # and 1e-40 sampled noise instead of the greedy answer.
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler changes this row's logits before choosing (``min_tokens``'s bans
        are per step and checked apart)."""
        return self.has_penalties or bool(self.logit_bias)

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        params = cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        # JSON object keys are strings: token ids come back as ints.
        params.logit_bias = {int(k): float(v) for k, v in (params.logit_bias or {}).items()}
        return params
