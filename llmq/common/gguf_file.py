"""A GGUF file's metadata and tensor table, read in one pass over its header (numpy, no torch).

``gguf``'s ``GGUFReader`` makes a numpy view (a memmap subclass, each costing microseconds) of
every part of every metadata value: a vocabulary of 262k strings is a million views, about 10 s
of a busy core for Gemma 3 270M's file and 5 s for SmolLM2-135M's (docs/performance.md,
"Start-up: a GGUF's load"), read twice per load. Here each value is read with ``struct`` from one
buffer; a string array (a vocabulary, a merge table) is walked for its end and kept as its
bytes, decoded only when its value is asked for; a numeric array is one ``numpy`` read. Values
are what ``ReaderField.contents()`` gives for the same key (strings decoded, arrays as lists),
and the tensors what ``GGUFReader.tensors`` lists (name, type, shape, offset), read from the
file on demand.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {  # GGUFValueType: struct format (no byte order), numpy dtype
    GGUFValueType.UINT8: ("B", np.uint8),
    GGUFValueType.INT8: ("b", np.int8),
    GGUFValueType.UINT16: ("H", np.uint16),
    GGUFValueType.INT16: ("h", np.int16),
    GGUFValueType.UINT32: ("I", np.uint32),
    GGUFValueType.INT32: ("i", np.int32),
    GGUFValueType.FLOAT32: ("f", np.float32),
    GGUFValueType.UINT64: ("Q", np.uint64),
    GGUFValueType.INT64: ("q", np.int64),
    GGUFValueType.FLOAT64: ("d", np.float64),
    GGUFValueType.BOOL: ("?", np.bool_),
}
# tensor types whose data gguf's reader gives as values of a numpy dtype; the others as bytes
_VALUE_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True, slots=True)
class StringArray:
    """An array of strings as the file holds it (each a u64 length and its bytes), decoded on
    ``values()``."""

    raw: bytes
    count: int

    def values(self) -> list[str]:
        raw, out, at = self.raw, [], 0
        length = struct.Struct("<Q").unpack_from
        for _ in range(self.count):
            (n,) = length(raw, at)
            out.append(raw[at + 8 : at + 8 + n].decode("utf-8"))
            at += 8 + n
        return out


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One tensor's entry, as ``gguf``'s ``ReaderTensor`` has it: ``shape`` fastest dimension
    first, ``data_offset`` from the start of the file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int

    def data_layout(self) -> tuple[np.dtype, tuple[int, ...]]:
        """The dtype and shape ``ReaderTensor.data`` has: values for float and integer types,
        each row's bytes for block types (and BF16)."""
        dims = tuple(reversed(self.shape))
        dtype = _VALUE_DTYPES.get(self.tensor_type)
        if dtype is not None:
            return np.dtype(dtype), dims
        return np.dtype(np.uint8), quant_shape_to_byte_shape(dims, self.tensor_type)


@dataclass(slots=True)
class GGUFFile:
    """The metadata (``values``: key -> the value's type path and value) and the tensor table
    of the GGUF file at ``path``."""

    path: str
    types: dict[str, tuple[GGUFValueType, ...]] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    tensors: list[GGUFTensorInfo] = field(default_factory=list)

    @classmethod
    def read(cls, path: str | Path) -> GGUFFile:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _Parser(cls(str(path)), buf).parse()

    def value(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` as ``ReaderField.contents()`` gives it; ``default`` where the
        file has no such key."""
        if key not in self.raw:
            return default
        raw = self.raw[key]
        if isinstance(raw, StringArray):
            return raw.values()
        if isinstance(raw, np.ndarray):
            return raw.tolist()
        return raw

    @staticmethod
    def numpy_dtype(kind: GGUFValueType) -> type:
        """The numpy dtype of a numeric metadata type."""
        return _SCALARS[kind][1]

    def count(self, key: str) -> int:
        """How many values the array ``key`` holds (without decoding a string array)."""
        raw = self.raw[key]
        return raw.count if isinstance(raw, StringArray) else len(raw)

    def metadata(self) -> dict[str, Any]:
        """Every key's value (string arrays decoded)."""
        return {key: self.value(key) for key in self.raw}

    def read_tensor(self, tensor: GGUFTensorInfo) -> np.ndarray:
        """The tensor's data as ``ReaderTensor.data`` holds it, read from the file into memory
        of its own (not a mapping: a mapping's pages stay in the process's RSS while it lives,
        docs/performance.md, "Choices: memory")."""
        dtype, shape = tensor.data_layout()
        out = np.empty(shape, dtype=dtype)
        with open(self.path, "rb") as f:
            f.seek(tensor.data_offset)
            if f.readinto(memoryview(out).cast("B")) != out.nbytes:
                raise ValueError(f"{self.path}: {tensor.name} runs past the end of the file")
        return out


class _Parser:
    """One pass over a GGUF header: magic, version, counts, key/values, tensor entries."""

    def __init__(self, into: GGUFFile, buf: mmap.mmap):
        self.into, self.buf, self.at = into, buf, 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (n,) = self.take("Q")
        self.at += n
        return self.buf[self.at - n : self.at].decode("utf-8")

    def parse(self) -> GGUFFile:
        if self.buf[:4] != b"GGUF":
            raise ValueError(f"{self.into.path} is not a GGUF file (no GGUF magic)")
        self.at = 4
        (version,) = self.take("I")
        if version not in _VERSIONS:
            byte_swapped = version & 0xFFFF == 0
            what = "big-endian" if byte_swapped else f"version {version}"
            raise ValueError(f"{self.into.path}: a {what} GGUF file is not read")
        tensor_count, kv_count = self.take("QQ")
        for _ in range(kv_count):
            key = self.string()
            if key in self.into.raw:
                raise ValueError(f"{self.into.path}: duplicate key {key}")
            (raw_type,) = self.take("I")
            self.into.types[key], self.into.raw[key] = self.value(GGUFValueType(raw_type))
        entries = [self.tensor_entry() for _ in range(tensor_count)]
        alignment = self.into.raw.get("general.alignment", _DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.into.path}: alignment {alignment} is not a power of two")
        start = -(-self.at // alignment) * alignment
        self.into.tensors = [self.tensor(start, *entry) for entry in entries]
        if len({t.name for t in self.into.tensors}) != len(entries):
            raise ValueError(f"{self.into.path}: a tensor name appears twice")
        return self.into

    def value(self, kind: GGUFValueType) -> tuple[tuple[GGUFValueType, ...], Any]:
        if kind in _SCALARS:
            return (kind,), self.take(_SCALARS[kind][0])[0]
        if kind == GGUFValueType.STRING:
            return (kind,), self.string()
        if kind != GGUFValueType.ARRAY:
            raise ValueError(f"{self.into.path}: unknown metadata value type {kind}")
        raw_item, count = self.take("IQ")
        item = GGUFValueType(raw_item)
        if item in _SCALARS:
            dtype = np.dtype(_SCALARS[item][1])
            values = np.frombuffer(self.buf, dtype, count, self.at).copy()
            self.at += dtype.itemsize * count
            return (kind, item), values
        if item == GGUFValueType.STRING:
            start, length = self.at, struct.Struct("<Q").unpack_from
            for _ in range(count):  # variable lengths: walked for the array's end
                self.at += 8 + length(self.buf, self.at)[0]
            return (kind, item), StringArray(self.buf[start : self.at], count)
        # arrays of arrays: flattened, as gguf's reader flattens them
        parts = [self.value(item) for _ in range(count)]
        inner = parts[0][0] if parts else (item,)
        flat = [v for _, p in parts for v in _as_list(p)]
        return (kind, *inner), flat

    def tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        (dims,) = self.take("I")
        shape = self.take(f"{dims}Q")
        raw_type, offset = self.take("IQ")
        return name, shape, raw_type, offset

    def tensor(self, start: int, name: str, shape, raw_type: int, offset: int) -> GGUFTensorInfo:
        kind = GGMLQuantizationType(raw_type)
        elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
        block, size = GGML_QUANT_SIZES[kind]
        return GGUFTensorInfo(
            name, kind, tuple(shape), elements, elements * size // block, start + offset
        )


def _as_list(raw: Any) -> list:
    if isinstance(raw, StringArray):
        return raw.values()
    if isinstance(raw, np.ndarray):
        return raw.tolist()
    return raw if isinstance(raw, list) else [raw]
