"""Projections with their weights packed once (bfloat16 on CPU): in oneDNN's blocked layout, or
in the panels of llmq's own matmul (``kernels/panel_matmul.cpp``) where the C++ kernels are
loaded and the CPU has AVX512-BF16.

``F.linear`` on a bfloat16 CPU tensor goes to oneDNN too, but reorders the plain row-major
weight into oneDNN's blocked layout inside every call. At decode batch sizes the matmul itself
is a few tens of microseconds, so the reorder is a large share of it: each weight is packed
once at load instead, with the same bits as ``F.linear`` (the same kernel, minus the reorder;
docs/performance.md, "What made the difference"). Packing is used only where it gives the
same bits; float32 keeps ``F.linear`` (its oneDNN kernel rounds differently from the
default one, and float32 is where output must equal transformers' ``generate``).

llmq's panels: the weights in the pair-interleaved order vdpbf16ps reads, 32 output columns a
panel, each panel one contiguous run: faster than the packed oneDNN matmul at every row
count (docs/performance.md, "What made the difference"). Not F.linear's bits (another
summation order): float32 keeps F.linear; bfloat16 output differs by roundings.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F

from llmq.common.settings import get_settings

log = logging.getLogger(__name__)

# torch.compile cannot trace a packed (opaque oneDNN) weight: a compiled graph calls
# ``llmq::linear(x, key)`` instead, whose ``key`` stands for a Linear (the same shape as its
# weight, found by its address) and whose kernel is that Linear's own call.
_BY_KEY: weakref.WeakValueDictionary[int, Linear] = weakref.WeakValueDictionary()
_LIB = torch.library.Library("llmq", "DEF")
_LIB.define("linear(Tensor x, Tensor key) -> Tensor")


# plain: F.linear on the row-major weight; onednn: oneDNN's packed matmul; panels: llmq's.
Layout = Literal["plain", "onednn", "panels"]
LAYOUT_CODES: dict[Layout, int] = {"plain": 0, "onednn": 1, "panels": 2}  # step_layers.cpp's
PANEL_COLUMNS = 32


def panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] as llmq's matmul reads it: [ceil(N / 32), K / 2, 32, 2], zero-padded."""
    n, k = weight.shape
    count = -(-n // PANEL_COLUMNS)
    padded = F.pad(weight, (0, 0, 0, count * PANEL_COLUMNS - n))
    return padded.view(count, PANEL_COLUMNS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def panels_fit(weight: torch.Tensor) -> bool:
    """Whether llmq's matmul serves ``weight``: bfloat16 on CPU, pairs of input columns, the
    kernels loaded with AVX512-BF16."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.shape[1] % 2 == 0
        and hasattr(torch.ops.llmq, "panel_matmul_available")
        and torch.ops.llmq.panel_matmul_available()
    )


# Which sums llmq's matmul takes (kernels/panel_matmul.cpp), chosen once per process.
_panel_sums: str | None = None
SUMS_CODES = {"dot": 0, "fma": 1, "amx": 2}  # panel_matmul.cpp's


def amx_available() -> bool:
    """Whether the matmul's AMX sums run here: built with AMX, tile data granted by the OS."""
    return bool(torch.ops.llmq.panel_matmul_amx_available())


@contextlib.contextmanager
def panel_sums(sums: str | bool) -> Iterator[None]:
    """The matmul's sums set to ``sums`` ("dot": vdpbf16ps, "fma": float32 FMAs, "amx": AMX
    tiles; True / False: "fma" / "dot") inside the block, as they were after it."""
    name = ("fma" if sums else "dot") if isinstance(sums, bool) else sums
    before = torch.ops.llmq.panel_matmul_sums()
    torch.ops.llmq.panel_matmul_set_sums(SUMS_CODES[name])
    try:
        yield
    finally:
        torch.ops.llmq.panel_matmul_set_sums(before)


def time_panel_sums(names: list[str], x: torch.Tensor, weights: list[torch.Tensor], repeats: int):
    """The best time (seconds) of a call with each of ``names``' sums, alternating, each call's
    weight the next of ``weights`` (copies past the caches where more than one)."""
    out_features = weights[0].shape[0] * PANEL_COLUMNS
    best = dict.fromkeys(names, float("inf"))
    for i in range(repeats):
        for name in names:
            weight = weights[i % len(weights)]
            with panel_sums(name):
                start = time.perf_counter()
                torch.ops.llmq.panel_matmul(x, weight, out_features, None)
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def choose_panel_sums(repeats: int = 15) -> str:
    """Time the matmul's sums, vdpbf16ps ("dot"), float32 FMAs ("fma", the same sums) and AMX
    tiles ("amx", where available), on a prompt chunk's shape (64 rows of a 576-wide input into
    1,536 outputs) and, for AMX, on a decode's (1 row of a 2,048-wide input into 2,048 outputs,
    four weights of 8 MiB in turn: from memory, as a decode reads them). AMX serves every row
    count where chosen, so it is taken only where faster on 64 rows and no slower than 1.05x
    vdpbf16ps on 1 row (and never where the ``amx`` setting is false); else the FMAs if at least 10% faster than vdpbf16ps on 64 rows: which is
    faster differs from CPU to CPU (docs/performance.md, "Choices: CPU kernels"). Timed once,
    at load."""
    global _panel_sums
    if _panel_sums is not None:
        return _panel_sums
    g = torch.Generator().manual_seed(0)
    names = ["dot", "fma", *(["amx"] if get_settings().amx and amx_available() else [])]
    chunk = [panels(torch.randn(1536, 576, generator=g).bfloat16())]
    best = time_panel_sums(names, torch.randn(64, 576, generator=g).bfloat16(), chunk, repeats)
    choice = "fma" if best["fma"] < 0.9 * best["dot"] else "dot"
    decode = {}
    if "amx" in names:
        big = [panels(torch.randn(2048, 2048, generator=g).bfloat16()) for _ in range(4)]
        x = torch.randn(1, 2048, generator=g).bfloat16()
        decode = time_panel_sums(["dot", "amx"], x, big, 2 * repeats)
        if best["amx"] < best[choice] and decode["amx"] <= 1.05 * decode["dot"]:
            choice = "amx"
    torch.ops.llmq.panel_matmul_set_sums(SUMS_CODES[choice])
    _panel_sums = choice
    log.info(
        "panel matmul: %s sums (a 64-row chunk: %s; 1 row of 2048x2048: %s)",
        choice,
        ", ".join(f"{name} {best[name] * 1e6:.0f} us" for name in names),
        ", ".join(f"{name} {us * 1e6:.0f} us" for name, us in decode.items()) or "not timed",
    )
    return _panel_sums


class Linear:
    """``y = x @ weight.T + bias`` for 2-D ``x``, its weight in ``layout``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: Layout):
        self.out_features = weight.shape[0]
        self.bias = bias
        self.layout = layout
        pack = layout != "plain"
        self.packed = pack
        if layout == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        elif layout == "panels":
            self.weight = panels(weight)
        else:
            self.weight = weight
        # Packed: one element, viewed in the weight's shape (a compiled graph reads only that).
        self.key = torch.empty(1, dtype=weight.dtype).expand(weight.shape) if pack else weight
        _BY_KEY[self.key.data_ptr()] = self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.llmq.linear(x, self.key)
        if self.layout == "panels":
            return torch.ops.llmq.panel_matmul(x, self.weight, self.out_features, self.bias)
        if self.packed:
            rows = x.shape[0]
            padded = padded_rows(rows)
            if padded != rows:
                x = F.pad(x, (0, 0, 0, padded - rows))
            out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return out[:rows] if padded != rows else out
        return F.linear(x, self.weight, self.bias)


def padded_rows(rows: int) -> int:
    """The row count a packed projection runs ``rows`` rows as.

    oneDNN builds (JIT-compiles) a primitive for every input shape and keeps up to 1,024 of
    them, each holding memory (docs/performance.md), so a step's token count, which takes any
    value up to the step budget (512), grew a worker by hundreds of MiB and kept building
    kernels. Rounded up, 36 row counts up to 512 reach oneDNN per projection: up
    to 16 rows as they are (a lone stream's decode), above in four steps per doubling (at most
    a quarter more rows, most often far less: decodes are bandwidth-bound, and a 128-token
    prefill chunk with 32 decodes is 160 rows as it is). The real rows' bits are unchanged
    (tested). The bound lowers a worker's peak RSS (docs/performance.md, "Choices: memory")."""
    if rows <= 16:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


def _linear(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return _BY_KEY[key.data_ptr()](x)


def _linear_shape(x: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], key.shape[0])


_LIB.impl("linear", _linear, "CPU")
torch.library.register_fake("llmq::linear", _linear_shape, lib=_LIB)


_PROBE_ROWS = (3, 33, 100)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether packing ``weight`` gives the same bits as ``F.linear`` on this machine."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    gen = torch.Generator().manual_seed(0)
    try:
        linear = Linear(weight, None, "onednn")
        # Row counts on either side of the kernels oneDNN switches between (on AMX hosts the
        # packed matmul leaves F.linear's bits from 33 rows, not at 3).
        probes = [torch.randn(rows, weight.shape[1], generator=gen) for rows in _PROBE_ROWS]
        probes = [p.to(weight.dtype) for p in probes]
        same = all(torch.equal(linear(p), F.linear(p, weight)) for p in probes)
    except RuntimeError as exc:  # a torch built without these oneDNN ops
        log.info("packed weights unavailable: %s", exc)
        return False
    if not same:
        log.info("packed weights differ from F.linear here; using F.linear")
    return same
