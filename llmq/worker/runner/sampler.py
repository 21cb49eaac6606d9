"""Token sampling, vectorized over the batch.

Greedy rows cost one argmax (:func:`fast_argmax`: torch's CPU argmax is a scalar loop, several
times slower than a vectorized max over the same logits). Random rows draw by inverse CDF (one
uniform against the running sum of p), which samples from p exactly. A seeded request draws its
uniform from a generator seeded by (seed, number of tokens generated so far): its tokens do not
depend on what shares its batch, and a request resumed on another worker draws the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmq.worker.engine.sequence import Sequence
from llmq.worker.runner.token_mask import TokenMask, apply_token_mask


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely tokens, most likely first


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


_SEED_STRIDE = 0x9E3779B97F4A7C15  # golden-ratio increment: well-spread per-step seeds
_MASK64 = (1 << 64) - 1


def _step_seed(seed: int, step: int) -> int:
    """A generator seed for a request's ``step``-th token (splitmix64 of the pair). Mixed, not
    summed: torch's CPU generator keeps only a seed's low 32 bits, so request seeds that
    differ in their high bits alone would otherwise draw the same tokens."""
    z = (seed + _SEED_STRIDE * step) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Sampler:
    def __init__(self, eos_token_ids: set[int] | frozenset[int] = frozenset()):
        self.eos_token_ids = sorted(eos_token_ids)

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], mask: TokenMask | None = None
    ) -> SamplerOutput:
        """``logits``: float32 [N, V], row i for ``seqs[i]``; ``mask``: the tokens a grammar
        allows in the constrained rows."""
        n = len(seqs)
        params = [s.params for s in seqs]
        raw = logits
        banned_rows: list[int] = []
        if mask is not None or any(p.min_tokens or p.adjusts_logits for p in params):
            logits = logits.clone()
            banned_rows = self._adjust(logits, seqs)
        want = [p.logprobs for p in params]
        if mask is not None:
            wants_logprobs = any(want[r] is not None for r in mask.rows)
            raw = _constrain(logits, raw, mask, banned_rows, wants_logprobs)

        greedy = [p.greedy for p in params]
        if all(greedy):
            token_ids = fast_argmax(logits).tolist()
        else:
            token_ids = self._sample_random(logits, seqs, greedy)

        logprobs: list[TokenLogprobs | None] = [None] * n
        if any(k is not None for k in want):
            logp = torch.log_softmax(raw, dim=-1)
            max_k = max(k or 0 for k in want)
            top_vals, top_ids = logp.topk(max_k, dim=-1) if max_k else (None, None)
            chosen = logp.gather(1, torch.tensor(token_ids, device=raw.device)[:, None])[:, 0]
            chosen = chosen.tolist()
            for i, k in enumerate(want):
                if k is None:
                    continue
                top = []
                if k:
                    top = list(zip(top_ids[i, :k].tolist(), top_vals[i, :k].tolist(), strict=True))
                    if mask is not None:  # a grammar may allow fewer than k tokens
                        top = [(t, v) for t, v in top if v != float("-inf")]
                logprobs[i] = TokenLogprobs(token_ids[i], chosen[i], top)
        return SamplerOutput(token_ids, logprobs)

    def _adjust(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logit_bias, min_tokens' bans and penalties, in place; the rows that got a bias or a
        ban (only those can lose every token a grammar allows)."""
        banned_rows: list[int] = []
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                bias = torch.tensor(list(p.logit_bias.values()), device=logits.device)
                logits[i, ids] += bias
                banned_rows.append(i)
            if seq.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")
                    banned_rows.append(i)
            if p.has_penalties:
                _apply_penalties(logits[i], seq)
        return banned_rows

    def _sample_random(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]
    ) -> list[int]:
        dev = logits.device
        params = [s.params for s in seqs]
        temps = torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], device=dev
        )
        logits = logits / temps[:, None]

        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = _top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            thresh = (
                torch.tensor(min_p, device=dev)[:, None] * probs.max(dim=-1, keepdim=True).values
            )
            probs = probs.masked_fill(probs < thresh, 0.0)

        # Inverse CDF: one uniform a row against the running sum (a vocabulary of exponential
        # draws, the other exact method, cost 27 ms a step at batch 32 on 2 cores; this, 1 ms).
        cdf = probs.cumsum(dim=-1)
        u = torch.rand(len(seqs), 1, device=dev)
        for i, seq in enumerate(seqs):
            seed = seq.params.seed
            if seed is not None and not greedy[i]:
                gen = torch.Generator(device=dev)
                gen.manual_seed(_step_seed(seed, seq.num_output_tokens + 1))
                u[i] = torch.rand(1, generator=gen, device=dev)
        # right=True: token i wins when cdf[i-1] <= u < cdf[i]; zero-probability tokens never.
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
        drawn = drawn.clamp_(max=probs.shape[-1] - 1)
        if any(greedy):
            rows = torch.tensor(greedy, device=dev)
            drawn = torch.where(rows, fast_argmax(logits), drawn)
        return drawn.tolist()


def _constrain(
    logits: torch.Tensor,
    raw: torch.Tensor,
    mask: TokenMask,
    banned_rows: list[int],
    logprobs: bool,
) -> torch.Tensor:
    """Mask the constrained rows of ``logits`` (a copy, after logit_bias, penalties and the
    min_tokens bans; before temperature, top-k/p and min-p, which is the same as after them:
    -inf / t is -inf and a forbidden token never survives a filter). Returns the logits that
    logprobs are taken from: the masked model logits where a constrained row asks for them,
    so they describe the distribution the token was drawn from, restricted to the grammar.

    Cost on the CPU (49152 tokens, one torch thread, 2 cores): the mask 0.03-0.05 ms for one
    row, 0.8-1.4 ms for 32; a greedy step's sampling 0.04-0.08 -> 0.09-0.18 ms and 0.2-0.3
    -> 1.3-2.2 ms (clone included). Filling the bitmask adds 0.005 and 0.05 ms."""
    apply_token_mask(logits, mask)
    # A row the bans left with no token at all (min_tokens forbids the end of sequence where
    # the grammar allows nothing else): the grammar wins over its bans and bias.
    constrained = set(mask.rows)
    for i in sorted(set(banned_rows) & constrained):
        if bool(logits[i].amax() == float("-inf")):
            logits[i] = raw[i]
            apply_token_mask(logits, TokenMask([i], mask.bitmask[[mask.rows.index(i)]]))
    if not logprobs:
        return raw
    raw = raw.clone()
    apply_token_mask(raw, mask)
    return raw


_ARGMAX_BLOCK = 256


def fast_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor, the same indices (first maximum; NaN counts as the
    maximum, as in torch), computed as a vectorized max per block of columns, the argmax of
    those block maxima, then an argmax inside the one winning block of each row."""
    n, v = x.shape
    c = _ARGMAX_BLOCK
    if x.device.type != "cpu" or v < 4 * c or x.stride(1) != 1:
        return x.argmax(dim=-1)
    main = v - v % c
    maxima = x[:, :main].unflatten(1, (main // c, c)).amax(dim=-1)  # [n, blocks]
    block = maxima.argmax(dim=-1)
    rows = torch.arange(n, device=x.device)
    starts = block * c
    cols = starts[:, None] + torch.arange(c, device=x.device)
    idx = starts + x.gather(1, cols).argmax(dim=-1)
    if main < v:  # the columns after the last whole block
        best = maxima[rows, block]
        tail = x[:, main:]
        tail_idx = tail.argmax(dim=-1)
        tail_best = tail[rows, tail_idx]
        later = (tail_best > best) | (tail_best.isnan() & ~best.isnan())
        idx = torch.where(later, tail_idx + main, idx)
    return idx


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    """vLLM's semantics: repetition over prompt and output tokens, presence and frequency over
    output tokens."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        out = torch.tensor(seq.output_token_ids, device=row.device)
        counts = torch.zeros_like(row).index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    dev = logits.device
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=dev)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    # Rows with top_p = 1 keep everything: float32 rounding can bring the running sum to 1.0
    # before the tail, which must not cut a row that asked for no filtering.
    before = probs.cumsum(dim=-1) - probs
    p = torch.tensor(top_p, device=dev)[:, None]
    drop |= (before >= p) & (p < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
