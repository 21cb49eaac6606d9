"""A draft model's proposals: a smaller model with the served model's tokenizer, loaded in the
same worker and run greedily for k tokens per sequence and step, batched across the step's
sequences, over a paged KV cache of its own (its own model runner and block manager).

The draft's cache follows the tokens each sequence keeps: before a step, what it holds past
the first token that differs from the sequence's (the drafts the target rejected) is dropped
and written over; the sequence's new tokens (a new sequence's prompt, within a token budget;
else the accepted drafts and the target's token) run as the first draft step, one ragged
batch, and each further draft token is one decode step of the sequences still drafting.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from llmq.worker.engine.block_manager import BlockManager
from llmq.worker.engine.scheduler import ScheduledSequence, SchedulerOutput
from llmq.worker.engine.sequence import Sequence

log = logging.getLogger(__name__)


class DraftRefused(ValueError):
    """The draft model cannot draft for the served one (another tokenizer, sliding windows)."""


@dataclass(slots=True)
class _Shadow:
    """The draft's copy of one sequence: its tokens (the target's, then the last drafts), block
    table and computed tokens, in ``seq``."""

    seq: Sequence
    target: Sequence  # the engine's sequence it follows
    synced: int = 0  # the target's tokens at the last step (it only appends after them)
    used: int = 0  # the last step it drafted in


class DraftModelProposer:
    def __init__(self, runner, blocks: BlockManager, vocab_size: int, max_chunk_tokens: int):
        """``runner``: the draft model's ModelRunner over ``blocks``' pool; ``vocab_size``:
        the served model's (a wider draft head is cut to it); ``max_chunk_tokens``: most
        tokens the first draft step runs (new prompts beyond it catch up over later steps)."""
        self.runner = runner
        self.blocks = blocks
        self.vocab_size = vocab_size
        self.max_chunk_tokens = max_chunk_tokens
        self.max_model_len = runner.max_model_len
        self._shadows: OrderedDict[str, _Shadow] = OrderedDict()  # least recently used first
        self._step = 0
        self.draft_steps = 0  # forward passes of the draft model

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        self._step += 1
        items, wanted = self._first_step(seqs, limits)
        drafts: dict[int, list[int]] = {}
        while items:
            logits, entries, _ = self.runner.execute(SchedulerOutput(items))
            self.draft_steps += 1
            tokens = logits[:, : self.vocab_size].argmax(-1).tolist()
            for item in items:
                item.seq.num_computed_tokens += item.num_new_tokens
            following = []
            for row, i in enumerate(entries):
                shadow = items[i].seq
                draft = drafts.setdefault(id(shadow), [])
                draft.append(tokens[row])
                shadow.token_ids.append(tokens[row])
                if len(draft) < wanted[id(shadow)]:
                    following.append(ScheduledSequence(shadow, shadow.num_computed_tokens, 1))
            items = following
        return [
            drafts.get(id(self._shadows[s.request_id].seq), [])
            if s.request_id in self._shadows
            else []
            for s in seqs
        ]

    def _first_step(
        self, seqs: list[Sequence], limits: list[int]
    ) -> tuple[list[ScheduledSequence], dict[int, int]]:
        """Each sequence's new tokens, as the first draft step runs them, and how many drafts
        each of those that reach their last token asks (by its shadow's id)."""
        items: list[ScheduledSequence] = []
        wanted: dict[int, int] = {}
        budget = self.max_chunk_tokens
        for seq, k in zip(seqs, limits, strict=True):
            if k <= 0 or seq.num_tokens + k > self.max_model_len or budget <= 0:
                continue
            shadow = self._synced(seq).seq
            new = shadow.num_tokens - shadow.num_computed_tokens
            run = min(new, budget)
            drafts = k - 1 if run == new else 0  # the last draft's KV is never written
            if not self._allocate(shadow, run + drafts):
                continue
            budget -= run
            items.append(ScheduledSequence(shadow, shadow.num_computed_tokens, run))
            if run == new:
                wanted[id(shadow)] = k
        return items, wanted

    def _synced(self, seq: Sequence) -> _Shadow:
        """``seq``'s shadow, its tokens the sequence's and its cache cut at the first token that
        differs (the sequence's last token always runs again: its logits start the draft)."""
        rid = seq.request_id
        shadow = self._shadows.get(rid)
        if shadow is None or shadow.target is not seq:
            if shadow is not None:
                self.blocks.free(shadow.seq)
            shadow = self._shadows[rid] = _Shadow(Sequence(rid, []), seq)
        self._shadows.move_to_end(rid)
        shadow.used = self._step
        own, tokens = shadow.seq, seq.token_ids
        end = min(own.num_computed_tokens, len(tokens) - 1)
        # The target only appends: its tokens before the last step's count are as they were.
        same = min(shadow.synced, end) if len(tokens) >= shadow.synced else 0
        while same < end and own.token_ids[same] == tokens[same]:
            same += 1
        del own.token_ids[same:]
        own.token_ids.extend(tokens[same:])
        own.num_computed_tokens = same
        self.blocks.trim(own)
        shadow.synced = len(tokens)
        return shadow

    def _allocate(self, seq: Sequence, num_new: int) -> bool:
        """Blocks for ``num_new`` more tokens of ``seq``, taken from the least recently drafting
        sequences' caches where the pool is short (they catch up again when they draft)."""
        while not self.blocks.allocate(seq, num_new):
            victim = next(iter(self._shadows.values()))
            if victim.used == self._step:
                return False
            self.forget(victim.target)
        return True

    def forget(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq.request_id, None)
        if shadow is not None:
            self.blocks.free(shadow.seq)


def load_draft_proposer(spec, target, tokenizer, engine_config, num_blocks: int, max_len: int):
    """The proposer of ``spec.draft_model`` for ``target`` (the served model, ``tokenizer``
    its tokenizer or None): refused by name where its tokenizer differs or it has sliding
    windows. Its pool has as many blocks as the target's, at most enough for twice the
    streams that draft at once (on a CPU a pool is resident only as it is written)."""
    from llmq.worker.engine.kv_groups import kv_layout
    from llmq.worker.kv_setup import served_features
    from llmq.worker.loading.model_loader import load_causal_lm
    from llmq.worker.runner.model_runner import ModelRunner

    draft = load_causal_lm(spec.draft_model, spec.dtype, spec.device, spec.draft_quantization)
    target_vocab = target.config.get_text_config().vocab_size
    check_vocab(spec.draft_model, draft, _target_name(target), target_vocab, tokenizer)
    features = served_features(draft)
    limit = getattr(draft.config.get_text_config(), "max_position_embeddings", None) or max_len
    max_len = min(max_len, limit)
    if kv_layout(features.layer_windows, max_len) is not None:
        raise DraftRefused(f"draft model {spec.draft_model} has sliding windows; none drafts")
    bs = engine_config.block_size
    blocks = min(num_blocks, 2 * max(spec.max_batch, 1) * -(-max_len // bs))
    runner = ModelRunner(
        draft,
        blocks,
        bs,
        fast_forward=engine_config.fast_forward,
        pack_weights=engine_config.pack_weights,
        small_step_threads=engine_config.small_step_threads,
        cuda_graphs=False,
        use_kernels=engine_config.cpu_kernels,
        max_batch_size=max(spec.max_batch, 1),
        max_model_len=max_len,
        features=features,
    )
    log.info("speculative decoding: draft model %s, %d KV blocks", spec.draft_model, blocks)
    manager = BlockManager(blocks, bs, enable_prefix_caching=False)
    chunk = max(engine_config.max_batch_tokens, 16)
    return DraftModelProposer(runner, manager, target_vocab, chunk)


def check_vocab(draft_name: str, draft, target_name: str, target_vocab: int, tokenizer) -> None:
    """Refuse a draft whose tokenizer is not the target's (or, with no tokenizer to compare,
    whose vocabulary is narrower than the target's)."""
    from llmq.common.model_files import load_tokenizer

    draft_vocab = draft.config.get_text_config().vocab_size
    if tokenizer is not None:
        tokenizer = tokenizer.load() if callable(getattr(tokenizer, "load", None)) else tokenizer
        ours, theirs = load_tokenizer(draft_name).get_vocab(), tokenizer.get_vocab()
        if ours != theirs:
            differ = len(set(ours.items()) ^ set(theirs.items()))
            raise DraftRefused(
                f"draft model {draft_name} has another tokenizer than {target_name} "
                f"({len(ours)} and {len(theirs)} tokens, {differ} entries differ)"
            )
    elif draft_vocab < target_vocab:
        raise DraftRefused(
            f"draft model {draft_name} has {draft_vocab} tokens, {target_name} {target_vocab}"
        )


def _target_name(target) -> str:
    config = target.config
    return getattr(config, "llmq_gguf_path", None) or config.name_or_path or "the served model"
