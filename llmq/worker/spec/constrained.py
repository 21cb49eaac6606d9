"""Drafts of grammar-constrained sequences: cut at the first token the grammar forbids before
the step, masked at every position in it (the matcher moved through the draft and back), and
the run a step yields fed to the matcher up to the token that completes or breaks it.

A matcher follows its sequence's tokens only: after the masks it is rolled back to where it
was, and the tokens it finally consumes are those the sequence keeps.
"""

from __future__ import annotations

from collections.abc import Mapping

import llguidance
import numpy as np

from llmq.worker.constrained_sequences import StepConstraints
from llmq.worker.engine.sequence import Sequence
from llmq.worker.grammar_compiler import first_line
from llmq.worker.runner.token_mask import TokenMask


def trim_drafts(matchers: Mapping[str, llguidance.LLMatcher], running: list[Sequence]) -> None:
    """Cut each constrained sequence's draft before the first token its grammar refuses: the
    rest could never be accepted."""
    for seq in running:
        if seq.draft and (m := matchers.get(seq.request_id)) is not None:
            seq.draft = seq.draft[: m.validate_tokens(seq.draft)]


def draft_masks(
    matchers: Mapping[str, llguidance.LLMatcher],
    entries: list[tuple[int, Sequence, list[int]]],
    vocab_size: int,
) -> TokenMask | None:
    """The allowed tokens at every row of the constrained entries: ``(first row, sequence,
    draft)``, the rows ``first .. first + len(draft)`` its positions in order."""
    rows: list[int] = []
    masks: list[np.ndarray] = []
    words = -(-vocab_size // 32)
    for first, seq, draft in entries:
        m = matchers.get(seq.request_id)
        if m is None:
            continue
        for j in range(len(draft) + 1):
            mask = np.full(words, -1, dtype=np.int32)
            m.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
            rows.append(first + j)
            masks.append(mask)
            if j < len(draft):
                m.consume_token(draft[j])
        if draft:
            m.rollback(len(draft))
    return TokenMask(rows, np.stack(masks)) if rows else None


def advance_runs(
    matchers: Mapping[str, llguidance.LLMatcher], runs: list[tuple[Sequence, list[int]]]
) -> StepConstraints:
    """Feed each constrained sequence the tokens its step yields, cutting its run (in place)
    after the token that completes its grammar or that the grammar refuses."""
    result = StepConstraints()
    for seq, run in runs:
        m = matchers.get(seq.request_id)
        if m is None:
            continue
        for i, token in enumerate(run):
            # An errored matcher allows and accepts the end of sequence: check its state too.
            if not m.consume_token(token) or m.is_error():
                result.failed[seq] = f"grammar error: {first_line(m.get_error())}"
            elif m.is_stopped():
                result.complete.add(seq)
            else:
                continue
            del run[i + 1 :]
            break
    return result
