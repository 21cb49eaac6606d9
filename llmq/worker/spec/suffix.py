"""Suffix decoding (Oliaro et al., SuffixDecoding; vLLM's ``suffix`` method): the continuation
that most often followed the longest match of a sequence's last tokens, in its own prompt and
output and in recent requests' outputs, is proposed, as long as the match is and while its
estimated probability stays above a floor.

Pure: no torch. Where a suffix tree holds every suffix with its counts, this finds the same
node on demand: an index of token pairs (pair -> the positions after its occurrences) gives
the candidates, each extended backwards to its match length; those at the longest match are
the node's occurrences, and their next tokens, counted, are its children. The trees Arctic
Inference builds in C++ cost a node per token and depth; a position per token is what this
keeps, in Python.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from llmq.worker.engine.sequence import Sequence

MAX_MATCH = 24  # the longest match looked for (Arctic Inference's tree depth)
CANDIDATES = 64  # the latest occurrences of the last pair, per source (own, recent requests)
MIN_PROB = 0.1  # a draft stops where its estimated probability falls below this
PROMPT_TAIL = 8  # prompt tokens kept before a finished request's output: its first tokens match
MAX_STORED = 4096  # tokens of one finished request kept, at most

Pair = tuple[int, int]


@dataclass(slots=True)
class _Own:
    """One sequence's pairs: pair -> the positions after its occurrences that have a token."""

    pairs: dict[Pair, list[int]] = field(default_factory=dict)
    indexed: int = 2  # pairs ending before this position are indexed


class SuffixProposer:
    def __init__(self, max_requests: int = 256):
        """``max_requests``: finished requests whose outputs are kept to propose from."""
        self.max_requests = max_requests
        self._own: dict[str, tuple[Sequence, _Own]] = {}
        self._texts: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, oldest first
        self._pairs: dict[Pair, list[tuple[int, int]]] = {}  # pair -> (text id, position after)
        self._next_id = 0
        self._live = 0  # index entries of kept texts
        self._dead = 0  # index entries of dropped texts, skipped until the index is rebuilt

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [self._propose_one(s, k) if k > 0 else [] for s, k in zip(seqs, limits, strict=True)]

    def forget(self, seq: Sequence) -> None:
        """Drop its own index; keep its output (after its prompt's last tokens) for others."""
        self._own.pop(seq.request_id, None)
        if self.max_requests and seq.num_output_tokens > 0:
            start = max(0, seq.num_prompt_tokens - PROMPT_TAIL)
            self._keep(seq.token_ids[start : start + MAX_STORED])

    @property
    def num_kept(self) -> int:
        return len(self._texts)

    def _propose_one(self, seq: Sequence, k: int) -> list[int]:
        ctx = seq.token_ids
        if len(ctx) < 3:
            return []
        own = self._grown(seq)
        pair = (ctx[-2], ctx[-1])
        found = [(ctx, p) for p in own.pairs.get(pair, ())[-CANDIDATES:]]
        texts = self._texts
        latest = self._pairs.get(pair, ())[-4 * CANDIDATES :]
        found += [(texts[t], p) for t, p in latest if t in texts][-CANDIDATES:]
        if not found:
            return []
        lengths = [_match_length(ctx, src, p) for src, p in found]
        longest = max(lengths)
        node = [c for c, m in zip(found, lengths, strict=True) if m == longest]
        return _walk(node, min(k, longest))

    def _grown(self, seq: Sequence) -> _Own:
        """``seq``'s pair index, grown by the tokens it gained since the last step."""
        tokens = seq.token_ids
        held, own = self._own.get(seq.request_id, (None, None))
        if held is not seq or own.indexed > len(tokens):  # new, or its tokens were replaced
            own = _Own()
            self._own[seq.request_id] = (seq, own)
        pairs = own.pairs
        for end in range(own.indexed, len(tokens)):  # each has a token after it
            pairs.setdefault((tokens[end - 2], tokens[end - 1]), []).append(end)
        own.indexed = max(own.indexed, len(tokens))
        return own

    def _keep(self, tokens: list[int]) -> None:
        tid, self._next_id = self._next_id, self._next_id + 1
        self._texts[tid] = tokens
        for end in range(2, len(tokens)):
            self._pairs.setdefault((tokens[end - 2], tokens[end - 1]), []).append((tid, end))
        self._live += max(0, len(tokens) - 2)
        while len(self._texts) > self.max_requests:
            _, old = self._texts.popitem(last=False)
            n = max(0, len(old) - 2)
            self._live -= n
            self._dead += n
        if self._dead > max(self._live, 4096):
            self._reindex()
        else:
            self._prune_dead_heads(tokens)

    def _prune_dead_heads(self, tokens: list[int]) -> None:
        """Drop the dropped texts' entries at the front of the lists just appended to (the
        oldest come first), so a lookup's latest entries are mostly live ones."""
        texts = self._texts
        for end in range(2, len(tokens)):
            entries = self._pairs[(tokens[end - 2], tokens[end - 1])]
            cut = 0
            while cut < len(entries) and entries[cut][0] not in texts:
                cut += 1
            if cut:
                del entries[:cut]
                self._dead -= cut

    def _reindex(self) -> None:
        self._pairs = {}
        for tid, tokens in self._texts.items():
            for end in range(2, len(tokens)):
                self._pairs.setdefault((tokens[end - 2], tokens[end - 1]), []).append((tid, end))
        self._dead = 0


def _match_length(ctx: list[int], src: list[int], p: int) -> int:
    """How many tokens before position ``p`` of ``src`` equal the last ones of ``ctx``."""
    n = len(ctx)
    m = 2  # the pair itself
    while m < MAX_MATCH and m < min(p, n) and src[p - m - 1] == ctx[n - m - 1]:
        m += 1
    return m


def _walk(node: list[tuple[list[int], int]], limit: int) -> list[int]:
    """From the occurrences ``(source, position after)`` of the match, the tokens that most
    of them continue with, one at a time, while the share that agreed stays above MIN_PROB."""
    draft: list[int] = []
    total = len(node)
    for j in range(limit):
        counts = Counter(src[p + j] for src, p in node if p + j < len(src))
        if not counts:
            break
        token, count = counts.most_common(1)[0]
        if count / total < MIN_PROB:
            break
        draft.append(token)
        node = [(src, p) for src, p in node if p + j < len(src) and src[p + j] == token]
    return draft
