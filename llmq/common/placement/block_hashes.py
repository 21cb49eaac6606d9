"""The chained hashes of a prompt's KV blocks: one definition for the worker's prefix cache
(``worker/engine/block_manager.py``, which registers a full block under its hash) and the
API's placement (``placement.py``, which asks which worker holds a prompt's first blocks).

A block's hash is Python's hash of (its predecessor's hash, its token ids): for a tuple of
ints it is the same in every process of a 64-bit CPython 3.8+ (``PYTHONHASHSEED`` salts
only str and bytes), so the API's values equal the worker's; a prefix that differs in any
earlier block differs in every later hash."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The hash of a full block of ``tokens`` after a block hashed ``parent`` (0: the first)."""
    return hash((parent, tokens))


def adapter_root(lora_name: str) -> int:
    """The parent of a prompt's first block under a LoRA adapter (0: the base model), so the
    same tokens under two adapters never share a block. A digest, not ``hash(str)``: that one
    is salted per process, and the API's chain must equal the worker's."""
    if not lora_name:
        return 0
    digest = hashlib.blake2b(lora_name.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


def chain_hashes(
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    hashes: list[int] | None = None,
    root: int = 0,
    salts: Mapping[int, int] | None = None,
) -> list[int]:
    """The hashes of the first ``num_blocks`` full blocks of ``token_ids``, extending
    ``hashes`` (the chain already computed for them, extended in place) where given; ``root``:
    the first block's parent (``adapter_root``); ``salts``: block index -> what else its
    content is (the images whose tokens it holds), folded into its hash."""
    hashes = [] if hashes is None else hashes
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else root
        if salts and i in salts:
            parent = hash((parent, salts[i]))
        hashes.append(block_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
    return hashes


def prompt_hashes(token_ids: Sequence[int], block_size: int, root: int = 0) -> list[int]:
    """The chain of every full block of a prompt (under the adapter whose root is ``root``)."""
    return chain_hashes(token_ids, block_size, len(token_ids) // block_size, root=root)
