"""Speculation in the engine's step: drafts proposed for the decoding sequences before the
scheduler runs, the target's token drawn at every draft position in one step, and the run of
drafts the draws agree with kept.

Pure: no torch. The rule is Leviathan et al.'s and Chen et al.'s rejection sampling for a draft
that is a point mass (a proposer that names one token, as prompt lookup does): draft ``d`` at
position j is kept with probability ``p_j(d)`` and on rejection the token is drawn from the
residual ``max(0, p_j - q) / Z`` = ``p_j`` without ``d``, renormalized. Drawing ``t_j ~ p_j`` as
the sampler would without speculation and keeping ``d`` exactly when ``t_j == d`` is that rule:
``P(t_j == d) = p_j(d)``, and a ``t_j != d`` is distributed as the residual. Every row is drawn
with the request's own processing (temperature, top-k/p, min-p, penalties, bias, seeds) as it
stands after the drafts before it, so a seeded request draws the same tokens with or without
speculation, and greedy output is the same token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmq.common.sampling_params import SamplingParams
from llmq.worker.engine.scheduler import ScheduledSequence
from llmq.worker.engine.sequence import Sequence
from llmq.worker.spec.proposer import Proposer
from llmq.worker.spec.step_cost import StepCost

KEPT_WEIGHT = 0.3  # a sequence's kept share: each verification moves it 30% of the way
DRIFT = 0.05  # a sequence left out moves 5% of the way back to all kept each step


@dataclass(slots=True)
class SpecStats:
    """Counters since the engine started: sequence-steps that verified a draft, draft tokens
    proposed and accepted."""

    verified: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying sequence-step: accepted drafts plus the target's own token."""
        return (self.accepted + self.verified) / self.verified if self.verified else 0.0


class DraftRow:
    """A sequence as it stands ``j`` draft tokens on, for the sampler's row of position j: its
    penalties, min_tokens and seeded draw see the drafts before it as generated."""

    __slots__ = ("_seq", "_extra", "params", "request_id", "num_prompt_tokens")

    def __init__(self, seq: Sequence, extra: list[int]):
        self._seq = seq
        self._extra = extra
        self.params: SamplingParams = seq.params
        self.request_id = seq.request_id
        self.num_prompt_tokens = seq.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self._seq.token_ids + self._extra

    @property
    def output_token_ids(self) -> list[int]:
        return self._seq.output_token_ids + self._extra

    @property
    def num_output_tokens(self) -> int:
        return self._seq.num_output_tokens + len(self._extra)


def accepted_run(sampled: list[int], draft: list[int]) -> list[int]:
    """The tokens one verification yields: the drafts while each equals the target's draw at
    its position, then the target's draw where they first differ (or after the last draft)."""
    for j, d in enumerate(draft):
        if sampled[j] != d:
            return sampled[: j + 1]
    return sampled[: len(draft) + 1]


class Speculator:
    def __init__(
        self,
        proposer: Proposer,
        num_tokens: int,
        max_batch: int,
        max_model_len: int,
    ):
        """``num_tokens``: most draft tokens per sequence and step; ``max_batch``: decoding
        sequences past which a step proposes nothing."""
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self.cost = StepCost()
        self._k: dict[str, int] = {}  # request id -> its draft length now (adaptive)
        # request id -> (drafts rejected whole in a row, steps it still sits out)
        self._misses: dict[str, tuple[int, int]] = {}
        self._kept: dict[str, float] = {}  # request id -> share of its drafts kept lately

    def prepare(self, running: list[Sequence]) -> None:
        """Set ``draft`` on the decoding sequences that speculate this step: those whose
        drafts were kept often enough lately to pay for their rows in a step of this many
        decoding sequences (StepCost)."""
        decoding = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        if len(decoding) > self.max_batch:
            return
        least = self.cost.least_acceptance(len(decoding))
        seqs = [
            s
            for s in decoding
            if s.params.speculative and not self._sits_out(s) and self._pays(s, least)
        ]
        limits = [self._limit(s) for s in seqs]
        for seq, draft in zip(seqs, self.proposer.propose(seqs, limits), strict=True):
            seq.draft = draft

    def observe(self, rows: int, seconds: float) -> None:
        """A decoding step (no prompt chunk) of ``rows`` rows took ``seconds``."""
        self.cost.observe(rows, seconds)

    def _pays(self, seq: Sequence, least: float) -> bool:
        """Whether ``seq``'s drafts are kept often enough (``least``); one left out drifts
        back toward all kept, so that it tries again (where its text turns to copying)."""
        rid = seq.request_id
        kept = self._kept.get(rid)
        if kept is None:
            return True
        if kept >= least:
            return True
        self._kept[rid] = kept + DRIFT * (1.0 - kept)
        return False

    def _sits_out(self, seq: Sequence) -> bool:
        """Whether ``seq`` proposes nothing this step: after drafts rejected whole twice in a
        row it sits out 2, then 4, up to 32 steps (free text seldom repeats; a checking step
        costs more than a plain one)."""
        misses, wait = self._misses.get(seq.request_id, (0, 0))
        if wait:
            self._misses[seq.request_id] = (misses, wait - 1)
        return wait > 0

    def _limit(self, seq: Sequence) -> int:
        """Its adaptive draft length, within what it may still generate (the target's own token
        comes after the drafts)."""
        p = seq.params
        room = min(p.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        return max(0, min(self._k.get(seq.request_id, self.num_tokens), room))

    @staticmethod
    def rows(item: ScheduledSequence) -> list[Sequence | DraftRow]:
        """The sampler's rows of one scheduled entry: the sequence, then one per draft."""
        seq, draft = item.seq, item.draft
        return [seq] + [DraftRow(seq, draft[:j]) for j in range(1, len(draft) + 1)]

    def verify(self, item: ScheduledSequence, sampled: list[int]) -> list[int]:
        """The tokens ``item`` yields, given the draws of its rows; its next draft length
        follows: one past what was accepted, doubled when all was."""
        draft = item.draft
        run = accepted_run(sampled, draft)
        accepted = len(run) - 1
        self.stats.verified += 1
        self.stats.proposed += len(draft)
        self.stats.accepted += accepted
        k = min(2 * len(draft), self.num_tokens) if accepted == len(draft) else accepted + 1
        rid = item.seq.request_id
        self._k[rid] = k
        kept = self._kept.get(rid, accepted / len(draft))
        self._kept[rid] = kept + KEPT_WEIGHT * (accepted / len(draft) - kept)
        misses = self._misses.get(rid, (0, 0))[0] + 1 if not accepted else 0
        self._misses[rid] = (misses, min(2 ** (misses - 1), 32) if misses >= 2 else 0)
        return run

    def forget(self, seq: Sequence) -> None:
        self._k.pop(seq.request_id, None)
        self._misses.pop(seq.request_id, None)
        self._kept.pop(seq.request_id, None)
        self.proposer.forget(seq)
