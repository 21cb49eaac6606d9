"""A request inside the engine: its tokens, its sampling parameters and its KV blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum

from llmq.common.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class LoraRef:
    """A LoRA adapter as a request names it: its name, and the PEFT folder it is read from. The
    same name with another folder is another adapter."""

    name: str
    path: str


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower runs first
    arrival: int = 0  # order of arrival among equal priorities; given by the caller
    # Tokens generated before this sequence reached this engine (a request resumed after its
    # worker died): they are recomputed like prompt tokens but count as output.
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # A model with sliding windows (``engine/kv_groups.py``): one table per KV group, the first
    # of them ``block_table`` itself; empty otherwise.
    block_tables: list[list[int]] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # Prompt tokens its last admission took from the prefix cache (kept after it finishes:
    # the usage reports them)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)  # hash chain of its full blocks
    num_registered_blocks: int = 0  # leading blocks already in the prefix cache
    finish_reason: FinishReason | None = None
    lora: LoraRef | None = None  # the adapter applied to it; None: the base model
    hash_root: int = 0  # the parent of its first block's hash (its adapter's; 0: the base's)
    # Block index -> the images (their content hashes) whose tokens it holds, folded into its
    # hash (worker/vision): image tokens are one id whatever the image.
    hash_salts: dict[int, int] = field(default_factory=dict)
    # Runs [start, end) of prompt positions that attend to each other both ways (a Gemma 3
    # image's tokens): a prefill chunk never ends inside one (``whole_runs``).
    bidirectional: list[tuple[int, int]] = field(default_factory=list)
    # Tokens a proposer guessed to follow (speculative decoding), for the next step to check;
    # the scheduler takes them.
    draft: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Prompt logprobs still to compute and send (with the first output): not for a request
        # resumed after output, whose first message (and record) already carried them.
        self.prompt_logprobs_pending = (
            self.params.prompt_logprobs is not None and not self.output_token_ids
        )
        self.prompt_logprobs: list[dict] = []  # for tokens 1.. of the prompt, as computed

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    def whole_runs(self, start: int, num_new: int, most: int) -> int:
        """``num_new`` tokens from ``start``, cut back to the start of a bidirectional run the
        chunk would end inside; a run the chunk starts in is taken whole, up to ``most``
        tokens (0: it waits for a step with room): a query of the run must see all its keys,
        and a later chunk's keys are not there yet."""
        end = start + num_new
        for first, last in self.bidirectional:
            if first < end < last:
                if first > start:
                    return first - start
                return last - start if last - start <= most else 0
        return num_new
