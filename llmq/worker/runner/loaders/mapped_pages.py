"""Dropping a weight file's pages from the process once their weights were copied out.

Loaded from a safetensors file of their own dtype, a model's weights are views of the file's
mapping. Building the forward copies each one (fused, packed or quantized), and every
page it read stays resident in the mapping until the whole file is unmapped, at the end, and
the build's peak RSS is several times what it keeps (docs/performance.md, "Choices: memory").
``release`` hands a copied weight's pages back as soon as it is copied
(``madvise(MADV_DONTNEED)``: a clean page of a file mapping is read again from the file if it
is touched later, so nothing is lost), and the peak falls to about what the forward keeps.

Only a range inside a mapping of a regular file is released (on anonymous memory the same call
would zero the pages), and only where no page of it was written: safetensors maps its files
private and writable, and a page written since (copied on write, no longer the file's) would be
lost, so ``/proc/self/pagemap`` is read first and such a range kept.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import numpy as np
import torch

log = logging.getLogger(__name__)

_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE
_PRESENT = 1 << 63
_FILE_PAGE = 1 << 61  # pagemap: a page of a file (or shared); cleared once copied on write


def _file_mapping_of(address: int) -> tuple[int, int] | None:
    """(start, end) of the private mapping of a regular file that holds ``address``; None where
    another kind of memory holds it. Only the line that holds it is parsed further: a forward's
    build makes hundreds of calls, and parsing every line each time cost seconds in all."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _, rest = line.partition(" ")
            low, _, high = span.partition("-")
            start, end = int(low, 16), int(high, 16)
            if not start <= address < end:
                continue
            parts = rest.split(maxsplit=4)  # perms, offset, device, inode, path
            if len(parts) < 5 or not parts[0].endswith("p"):
                return None
            path = parts[4].rstrip("\n")
            if path.startswith("/dev/") or not os.path.isfile(path):
                return None
            return start, end
    return None


def release(tensor: torch.Tensor) -> int:
    """Drop the whole pages under ``tensor`` (contiguous, on the CPU) where they lie in a file
    mapping; the bytes released. Call it once its values were copied and nothing reads it
    again (a later read faults the file's own bytes in again). The mappings are read at each
    call: one unmapped since and reused for other memory is never taken for a file's."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
        return 0
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    start = -(-first // _PAGE) * _PAGE  # the pages wholly inside the tensor
    end = last // _PAGE * _PAGE
    if end <= start:
        return 0
    try:
        span = _file_mapping_of(first)
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # no /proc: nothing is released
        return 0
    if span is None or last > span[1]:
        return 0
    if _written(start, end):
        log.debug("pages written since mapped: kept")
        return 0
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED):
        log.debug("madvise failed (errno %d): pages kept", ctypes.get_errno())
        return 0
    return end - start


def _written(start: int, end: int) -> bool:
    """Whether a present page in [start, end) is no longer the file's (written: anonymous)."""
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(start // _PAGE * 8)
            entries = np.frombuffer(pagemap.read((end - start) // _PAGE * 8), dtype=np.uint64)
    except OSError:
        return True  # unknown: keep the pages
    flags = entries & np.uint64(_PRESENT | _FILE_PAGE)
    return bool((flags == np.uint64(_PRESENT)).any())


def released_as_run(model: torch.nn.Module) -> list:
    """Hooks that ``release`` each module's own parameters once its forward has run: a pass
    over the whole model (the attention probe) then holds one layer's pages resident at a
    time, not the file. Whatever reads a weight next faults it in again
    (from the page cache). Remove the returned handles after the pass."""

    def drop(module: torch.nn.Module, _args, _out) -> None:
        for p in module.parameters(recurse=False):
            release(p.detach())

    return [m.register_forward_hook(drop) for m in model.modules()]
