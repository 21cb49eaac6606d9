"""Where a prompt leaves the think block (open: the output starts in reasoning) and how many
of a choice's tokens are its reasoning."""

from __future__ import annotations

from llmq.common.serving.reasoning.formats import ReasoningFormat

# The prompt's last tokens decoded to find its last tag: enough for a tag and the whitespace
# around it, whatever the tokenizer makes of them.
_PROMPT_TAIL_TOKENS = 64


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def prompt_opens_block(tokenizer, fmt: ReasoningFormat, prompt_ids: list[int]) -> bool:
    """The prompt ends inside a think block (its template opened one for the model)."""
    tail = _decode(tokenizer, prompt_ids[-_PROMPT_TAIL_TOKENS:])
    return tail.rfind(fmt.start) > tail.rfind(fmt.end)


def single_token(tokenizer, tag: str) -> int | None:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def reasoning_tokens(tokenizer, fmt: ReasoningFormat, token_ids: list[int]) -> int:
    """The tokens of an output that reasons, up to its closing tag included (the tags count
    as reasoning: completion tokens are reasoning tokens plus the content's); all of them when
    the block never closed."""
    end_id = single_token(tokenizer, fmt.end)
    if end_id is not None and end_id in token_ids:
        return token_ids.index(end_id) + 1
    if fmt.end not in _decode(tokenizer, token_ids):
        return len(token_ids)
    low, high = 1, len(token_ids)  # the fewest tokens whose text holds the tag (several tokens)
    while low < high:
        mid = (low + high) // 2
        if fmt.end in _decode(tokenizer, token_ids[:mid]):
            high = mid
        else:
            low = mid + 1
    return low
