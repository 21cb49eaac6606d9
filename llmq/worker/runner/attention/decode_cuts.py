"""Where to cut a step's decodes (sorted by context) into chunks gathered together: each chunk
is padded to its own longest context, and a chunk costs a fixed amount on top. Pure: no torch."""

from __future__ import annotations

# Fixed cost of one decode chunk (a handful of tensor ops per layer), in gathered token slots:
# splitting the decodes into one more chunk pays off only when it saves more padding than this.
CHUNK_COST_SLOTS = 1024
MAX_DECODE_CHUNKS = 4


def best_cuts(ends: list[int], nbs: list[int], block_size: int) -> list[int]:
    """End rows of the chunks (a subset of the run ends ``ends``, the last one included), for
    decodes of ``nbs`` blocks each (non-decreasing)."""
    cost_chunk = CHUNK_COST_SLOTS
    bs = block_size
    k = len(ends)
    if k == 1:
        return ends
    # best[j]: least cost of rows [0, ends[j]); prev[j]: the run end before its last chunk.
    inf = float("inf")
    best = [inf] * k
    prev = [-1] * k
    for j in range(k):
        hi = ends[j]
        width = nbs[hi - 1] * bs
        for i in range(-1, j):
            lo = ends[i] if i >= 0 else 0
            c = (best[i] if i >= 0 else 0) + cost_chunk + (hi - lo) * width
            if c < best[j]:
                best[j] = c
                prev[j] = i
    cuts: list[int] = []
    j = k - 1
    while j >= 0:
        cuts.append(ends[j])
        j = prev[j]
    cuts.reverse()
    while len(cuts) > MAX_DECODE_CHUNKS:
        # Merge the chunk whose rows, padded to the next chunk's width, cost least.
        extra = [
            (cuts[m] - (cuts[m - 1] if m else 0)) * (nbs[cuts[m + 1] - 1] - nbs[cuts[m] - 1])
            for m in range(len(cuts) - 1)
        ]
        del cuts[extra.index(min(extra))]
    return cuts
