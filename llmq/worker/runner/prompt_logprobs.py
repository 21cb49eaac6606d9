"""Prompt logprobs, reduced from one step's prompt rows as prefill runs: per prompt token its
logprob, its rank and the k most likely tokens. Only these few numbers outlive the step: the
prompt x vocabulary logits are never gathered, each chunk's rows are reduced and dropped."""

from __future__ import annotations

import torch

from llmq.worker.runner.packed_batch import PromptRows

# Rows reduced at once: bounds the float32 temporaries (log-softmax and comparisons) to this
# many rows of the vocabulary, whatever the chunk's size.
REDUCE_ROWS = 64


def reduce_prompt_rows(logits: torch.Tensor, rows: list[PromptRows]) -> None:
    """Append to each sequence's ``prompt_logprobs`` the entries of its rows; ``logits``: float32,
    the rows of ``rows`` in order. A sequence's first chunk (token 1 on) starts its list anew:
    a prompt preempted and recomputed scores its tokens again."""
    at = 0
    for pr in rows:
        seq = pr.seq
        if pr.first == 1:
            seq.prompt_logprobs = []
        targets = seq.token_ids[pr.first : pr.first + pr.count]
        k = seq.params.prompt_logprobs or 0
        for lo in range(0, pr.count, REDUCE_ROWS):
            hi = min(pr.count, lo + REDUCE_ROWS)
            block = logits[at + lo : at + hi]
            seq.prompt_logprobs.extend(_entries(block, targets[lo:hi], k))
        at += pr.count


def _entries(logits: torch.Tensor, targets: list[int], k: int) -> list[dict]:
    logp = torch.log_softmax(logits, dim=-1)
    ids = torch.tensor(targets, device=logp.device)[:, None]
    chosen = logp.gather(1, ids)
    ranks = (logp > chosen).sum(dim=-1) + 1
    chosen_list = chosen[:, 0].tolist()
    rank_list = ranks.tolist()
    top_ids: list[list[int]] = [[] for _ in targets]
    top_vals: list[list[float]] = [[] for _ in targets]
    if k:
        vals, idx = logp.topk(k, dim=-1)
        top_ids, top_vals = idx.tolist(), vals.tolist()
    return [
        {
            "token_id": t,
            "logprob": chosen_list[i],
            "rank": rank_list[i],
            "top": [[a, b] for a, b in zip(top_ids[i], top_vals[i], strict=True)],
        }
        for i, t in enumerate(targets)
    ]
