"""A proposer for the engine's speculation tests: it knows each prompt's output without
speculation and proposes it, with every ``wrong_every``-th token of the output changed, so
that steps accept some drafts and reject others (prompt lookup on a random model rarely has
anything right to propose)."""

from __future__ import annotations

from llmq.worker.engine.sequence import Sequence


class OracleProposer:
    def __init__(self, outputs: dict[tuple, list[int]], vocab: int, wrong_every: int = 4, key=None):
        """``outputs``: by ``key(seq)`` (default: its prompt's tokens, as a tuple)."""
        self.outputs = outputs
        self.key = key or (lambda seq: tuple(seq.prompt_token_ids))
        self.vocab = vocab
        self.wrong_every = wrong_every
        self.calls = 0

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        self.calls += 1
        return [self._one(s, k) for s, k in zip(seqs, limits, strict=True)]

    def _one(self, seq: Sequence, k: int) -> list[int]:
        known = self.outputs.get(self.key(seq), [])
        at = seq.num_output_tokens
        draft = list(known[at : at + k])
        for j in range(len(draft)):
            if (at + j) % self.wrong_every == self.wrong_every - 1:
                draft[j] = (draft[j] + 1) % self.vocab
        return draft

    def forget(self, seq: Sequence) -> None:
        pass
