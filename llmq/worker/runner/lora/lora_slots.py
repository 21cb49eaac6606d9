"""The loaded adapters' weights stacked per fused projection, one slot each, and one step's
deltas computed from them.

Per fused projection one A of [layers, slots, parts x room, in] (each part's A in its own block
of rows) and one B transposed, [layers, slots, room, out] (each output column's rows are its
part's B), zero past an adapter's rank and for a part it does not target.

On CPU with llmq's kernels, ``kernels/lora_deltas.cpp`` adds every adapter's deltas of a
projection in one call, reading each adapter's weights once, in the model's dtype, and only its
rank's rows (its docstring gives the figures). Elsewhere torch's ops do, per projection: the
rows of each adapter gathered into its slot (padded to the largest group with zero rows), one
batched matmul with A, one per part with B, times each slot's scale, added back to the rows. A
few ops per projection whatever the number of adapters, where a matmul per adapter cost two
each, faster than adapter by adapter (docs/performance.md, "Choices: weights"). A step whose
groups are very unequal (a long prefill chunk beside decodes) would pad too much: its deltas
are added run by run instead. There, on CPU, the slots hold float32 whatever the model's
dtype: bfloat16 matmuls this small run far slower than float32 on a CPU without bfloat16 in
hardware (docs/performance.md).
"""

from __future__ import annotations

import torch

from llmq.worker.runner.lora.lora_weights import PARTS, AdapterWeights, BaseShape

_NONE = torch.empty(0)  # step_layers' "no such tensor"

# Batched deltas while padding adds at most this share of rows (plus a few): beyond, run by run.
MAX_PADDING = 2.0


class LoraSlots:
    def __init__(
        self, shape: BaseShape, num_slots: int, dtype: torch.dtype, device, kernel: bool = False
    ):
        self.kernel = kernel  # kernels/lora_deltas.cpp adds the deltas (CPU, kernels loaded)
        self.num_layers = shape.num_layers
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = device
        self.widths = shape.widths  # part -> (out, in)
        # fused projection -> its parts' (first output column, width) in its output
        self.columns: dict[str, list[tuple[int, int]]] = {}
        for fused, parts in PARTS.items():
            if all(p in shape.widths for p in parts):
                starts = [sum(shape.widths[q][0] for q in parts[:i]) for i in range(len(parts))]
                self.columns[fused] = [
                    (c, shape.widths[p][0]) for c, p in zip(starts, parts, strict=True)
                ]
        # fused projection -> its parts' first columns, then its width (lora_deltas' columns)
        self.bounds = {
            fused: [c for c, _ in cols] + [cols[-1][0] + cols[-1][1]]
            for fused, cols in self.columns.items()
        }
        self.a: dict[str, torch.Tensor] = {}  # allocated as adapters first target each
        self.bt: dict[str, torch.Tensor] = {}
        self.rank: dict[str, int] = {}  # each part's room in the slots
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.scale_of = [0.0] * num_slots
        self.rank_of = [0] * num_slots  # each slot's adapter's rank

    def put(self, slot: int, adapter: AdapterWeights) -> None:
        """Write ``adapter`` into ``slot`` (over whatever was there); its own tensors are then
        released (the slot holds them)."""
        for fused, parts in PARTS.items():
            if fused not in self.columns:
                continue
            targeted = any(p in layer for layer in adapter.layers for p in parts)
            if fused not in self.a and not targeted:
                continue
            if targeted and adapter.rank > self.rank.get(fused, 0):
                self._grow(fused, adapter.rank)
            room = self.rank[fused]
            self.a[fused][:, slot].zero_()
            self.bt[fused][:, slot].zero_()
            for i, (part, (col, width)) in enumerate(zip(parts, self.columns[fused], strict=True)):
                for layer, deltas in enumerate(adapter.layers):
                    d = deltas.get(part)
                    if d is not None:
                        rank = d.a.shape[0]
                        self.a[fused][layer, slot, i * room : i * room + rank] = d.a
                        self.bt[fused][layer, slot, :rank, col : col + width] = d.b.t()
        self.scales[slot] = adapter.scale
        self.scale_of[slot] = adapter.scale
        self.rank_of[slot] = adapter.rank
        adapter.slot = slot
        adapter.layers = []

    def _grow(self, fused: str, rank: int) -> None:
        """Room for ``rank`` per part in every slot of ``fused``, the slots' weights kept."""
        parts = PARTS[fused]
        k = self.widths[parts[0]][1]
        lead = (self.num_layers, self.num_slots)
        new = dict(dtype=self.dtype, device=self.device)
        n = sum(self.widths[p][0] for p in parts)
        a = torch.zeros(*lead, len(parts) * rank, k, **new)
        bt = torch.zeros(*lead, rank, n, **new)
        old = self.rank.get(fused, 0)
        for i in range(len(parts) if old else 0):
            a[:, :, i * rank : i * rank + old] = self.a[fused][:, :, i * old : (i + 1) * old]
        if old:
            bt[:, :, :old] = self.bt[fused]
        self.a[fused], self.bt[fused], self.rank[fused] = a, bt, rank

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.a.values(), *self.bt.values()))


class StepAdapters:
    """One step's adapters: ``groups`` are (slot, its rows in increasing order); rows without
    adapter are in none."""

    def __init__(self, groups: list[tuple[int, list[int]]], slots: LoraSlots, num_rows: int):
        self.slots = slots
        device = slots.device
        # lora_deltas' rows, grouped, and its (slot, first, past the last) triples over them
        self.rows = torch.tensor([r for _, rows in groups for r in rows], device=device)
        self.groups, start = [], 0
        for slot, rows in groups:
            self.groups += [slot, start, start + len(rows)]
            start += len(rows)
        runs = [(slot, lo, hi) for slot, rows in groups for lo, hi in _runs(rows)]
        self.runs = runs
        self.count = max(slot for slot, _ in groups) + 1  # slots [0, count) take part
        self.width = max(len(rows) for _, rows in groups)  # rows per slot, padded
        total = sum(len(rows) for _, rows in groups)
        padded = self.count * self.width
        self.batched = len(runs) > 1 and padded <= MAX_PADDING * total + 16
        self.identity, self.src, self.mask = False, None, None
        if not self.batched or slots.kernel:
            return
        src, valid = [0] * padded, [0.0] * padded
        for slot, rows in groups:
            for j, row in enumerate(rows):
                src[slot * self.width + j] = row
                valid[slot * self.width + j] = 1.0
        # Every row in its slot's place already (one adapter a run, in slot order): views.
        self.identity = padded == num_rows and src == list(range(num_rows)) and all(valid)
        self.src = torch.tensor(src, dtype=torch.long, device=device)
        if not all(valid):  # padding rows zeroed: their deltas are zero
            self.mask = torch.tensor(valid, dtype=slots.dtype, device=device).unsqueeze(1)

    def step_layers_args(self) -> tuple:
        """These adapters as ``kernels/step_layers.cpp`` takes them (its ``Adapters``)."""
        slots = self.slots
        weights = []
        for fused in PARTS:
            weights += [slots.a.get(fused, _NONE), slots.bt.get(fused, _NONE)]
        return weights, slots.scales, self.rows, self.groups, slots.rank_of

    def add_deltas(self, x: torch.Tensor, y: torch.Tensor, layer: int, fused: str) -> torch.Tensor:
        """``y`` (the base projection of ``x``) with each adapter's delta added to its rows."""
        slots = self.slots
        a = slots.a.get(fused)
        if a is None:  # no loaded adapter targets this projection
            return y
        a, bt = a[layer], slots.bt[fused][layer]
        if slots.kernel:
            columns, ranks = slots.bounds[fused], slots.rank_of
            torch.ops.llmq.lora_deltas(
                y, x, a, bt, columns, slots.scales, self.rows, self.groups, ranks
            )
            return y
        if self.batched:
            return self._batched(x, y, a, bt, fused)
        for slot, lo, hi in self.runs:
            xa = torch.mm(x[lo:hi].to(a.dtype), a[slot].t())
            d = self._expand(xa, bt[slot], fused, torch.mm)
            y[lo:hi] += (d * slots.scale_of[slot]).to(y.dtype)
        return y

    def _expand(self, xa: torch.Tensor, bt: torch.Tensor, fused: str, matmul) -> torch.Tensor:
        """``xa`` (x times each part's A, side by side) times each part's B: every part's
        columns, side by side."""
        room = self.slots.rank[fused]
        parts = [
            matmul(xa[..., i * room : (i + 1) * room], bt[..., col : col + width])
            for i, (col, width) in enumerate(self.slots.columns[fused])
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def _batched(self, x, y, a, bt, fused: str) -> torch.Tensor:
        count, width = self.count, self.width
        xg = x if self.identity else x.index_select(0, self.src)
        xg = xg.to(a.dtype)
        if self.mask is not None:
            xg = xg * self.mask
        # Not through oneDNN: its float32 bmm of these small shapes was hundreds of times slower
        # than torch's own batched gemm (docs/performance.md, "Choices: weights").
        mkldnn = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            xa = torch.bmm(xg.view(count, width, -1), a[:count].transpose(1, 2))
            d = self._expand(xa, bt[:count], fused, torch.bmm)
        finally:
            torch._C._set_mkldnn_enabled(mkldnn)
        d *= self.slots.scales[:count].view(count, 1, 1).to(d.dtype)
        d = d.view(count * width, -1).to(y.dtype)
        return y.add_(d) if self.identity else y.index_add_(0, self.src, d)


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Increasing ``rows`` as runs of consecutive rows, [lo, hi) each."""
    runs = []
    lo = prev = rows[0]
    for row in rows[1:]:
        if row != prev + 1:
            runs.append((lo, prev + 1))
            lo = row
        prev = row
    runs.append((lo, prev + 1))
    return runs
