"""Layers grouped by attention type, so that sliding-window layers hold only their windows.

A model whose layers all attend every earlier token keeps one block table per sequence, a block
id indexing every layer's cache (no layout: the block manager and the runner take their plain
path). A model with sliding windows shorter than its context gets a :class:`KVLayout`, as
vLLM's hybrid allocator does: its layers are grouped by window (None: full attention) into
groups of the same number of layers (``width``: the fewest layers of any window, a group of a
window with more layers than a multiple of it left partly empty), each sequence holds one block
table per group, and every group draws blocks from one pool whose block holds ``width`` layers.
A sliding group gives back the blocks that fell out of its window as the sequence advances
(``engine/windowed_blocks.py``), so a Gemma 3 conversation of 16k tokens holds its global layers'
16k and its local layers' 1,024 (+ a block) tokens, not every layer's 16k.

Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

# A table entry of a sliding group whose block fell out of the window: it points nowhere.
NULL_BLOCK = -1


@dataclass(frozen=True, slots=True)
class KVGroup:
    window: int | None  # None: full attention
    layers: tuple[int, ...]  # model layers whose keys and values its blocks hold, in slot order


@dataclass(frozen=True, slots=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    width: int  # layers per block: the pool's storage slots
    num_layers: int

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    def layer_group(self, layer: int) -> int:
        for i, group in enumerate(self.groups):
            if layer in group.layers:
                return i
        raise KeyError(f"layer {layer} is in no KV group")

    def layer_slots(self) -> list[int]:
        """Per model layer, the storage slot its keys and values take in a block."""
        slots = [0] * self.num_layers
        for group in self.groups:
            for slot, layer in enumerate(group.layers):
                slots[layer] = slot
        return slots


def kv_layout(layer_windows: Seq[int | None], max_model_len: int) -> KVLayout | None:
    """The layout for layers asking these windows (None: full attention); None where no
    window shorter than ``max_model_len`` saves anything (one table, today's path)."""
    windows = [w if w is not None and w < max_model_len else None for w in layer_windows]
    if all(w is None for w in windows):
        return None
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    width = min(len(layers) for layers in by_window.values())
    groups = [
        KVGroup(window, tuple(layers[i : i + width]))
        for window, layers in by_window.items()
        for i in range(0, len(layers), width)
    ]
    groups.sort(key=lambda g: g.layers[0])
    return KVLayout(tuple(groups), width, len(windows))


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def first_window_block(next_query: int, window: int, block_size: int) -> int:
    """The first block a query at ``next_query`` (and every later one) still reads: it sees
    keys ``next_query - window + 1 .. next_query``."""
    return max(0, (next_query - window + 1) // block_size)


def window_bound(window: int, block_size: int, chunk_tokens: int = 1) -> int:
    """The most blocks a sliding group of ``window`` holds for one sequence that computes
    ``chunk_tokens`` tokens in its step: the window behind its first new token, and them."""
    return blocks_for(window - 1 + chunk_tokens, block_size) + 1


def sequence_blocks(
    windows: Seq[int | None], tokens: int, block_size: int, chunk_tokens: int = 1
) -> int:
    """Blocks a sequence of ``tokens`` tokens holds at most, over groups of these windows."""
    full = blocks_for(tokens, block_size)
    return sum(
        full if w is None else min(full, window_bound(w, block_size, chunk_tokens)) for w in windows
    )
