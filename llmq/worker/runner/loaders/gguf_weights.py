"""A GGUF file's quantized tensors as llmq's quantized projections.

The model comes without its quantized weights (``worker/loading/gguf_model.py``: ``lean``), or, where
that cannot be, dequantized to floats by transformers; either way this reads the file's own
blocks for the kernels:

- Q4_K (llama.cpp's 4-bit k-quant: 256-value super-blocks of eight 32-value sub-blocks, each
  ``w = d * sc * q - dmin * m`` with 6-bit sc and m, q in 0..15) is llmq's ``Int4Blocks``
  exactly: the same d, dmin and q, the codes held in 8 bits (m negated); tested against
  ``gguf``'s ``dequantize``. On torch's kernels (no AVX2), scale and zero are rounded to
  bfloat16.
- Q5_K (Q4_K's blocks with a fifth bit a value, q in 0..31) is llmq's ``Int6Blocks`` exactly,
  on its 6-bit kernel (6.625 bits a weight where int8 takes 8.5); so is a fused group of Q4_K
  and Q5_K members. Tested against ``gguf``'s ``dequantize``.
- Q8_0 (32 int8 values and one float16 scale a block) is llmq's grouped int8 exactly: the same
  q and scale, tested against ``gguf``'s ``dequantize``.
- Q6_K (``w = d * sc * (q - 32)``, q in 0..63, an int8 sc per 16 values) is llmq's
  ``Q6KBlocks`` exactly, on the 6-bit kernel with its sub-blocks' scales (6.5625 bits a
  weight); tested against ``gguf``'s ``dequantize``.
- Q4_0, Q5_0, IQ4_NL, IQ4_XS, Q3_K, Q4_1 and Q5_1: ``gguf_blocks.py`` (int8, Q6_K's blocks,
  int4 and 6-bit groups with float16 d and m; which are exact, and the error of IQ4_XS's).
- Float tensors (F32, F16, BF16) are kept float, in the model's dtype (a file of float weights
  only is not quantized at all: ``worker/loading/gguf_model.py``'s ``float_dtype``).
- Q2_K, fused groups whose members differ otherwise (Q4_K_M's Q6_K ``attn_v`` beside Q4_K q,
  k; k-quant beside Q4_1 or Q5_1 members), and the 6-bit forms where the 6-bit kernel does not serve (no AVX2, CUDA) are quantized
  again to int8 from their dequantized weights (group-32 scales on llmq's kernels, per
  channel on torch's).
- Any other type refuses the model, naming it (``UnsupportedGGUFType``).

Query and key rows come permuted in llama.cpp's files (its rotary layout); they are put back as
transformers' loader puts them back.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from llmq.common.gguf_file import GGUFFile
from llmq.worker.loading.gguf_model import EMBEDDING, FLOAT_TYPES, HEAD, ROLE_TENSORS, SERVED_TYPES
from llmq.worker.runner.forward.model_support import UnsupportedModel
from llmq.worker.runner.linear.quantized_linear import (
    Int4Blocks,
    Int4Linear,
    Int6Blocks,
    Int6Linear,
    Int8Linear,
    Int8Weight,
    Q6KLinear,
    QuantizedLinear,
    int_kernel_available,
    quantized_linear,
)
from llmq.worker.runner.linear.quantized_weights import Int4Groups, Int6Groups, Q6KBlocks
from llmq.worker.runner.loaders.gguf_blocks import (
    iq4_nl_weight,
    iq4_xs_weight,
    q3_k_weight,
    q4_0_weight,
    q4_1_weight,
    q5_0_weight,
    q5_1_weight,
)

log = logging.getLogger(__name__)

Q4_K_BLOCK = 144  # bytes: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of nibbles
Q5_K_BLOCK = 176  # bytes: Q4_K's, with 32 bytes of fifth bits before the nibbles
FLOAT_ROWS = 1024  # rows dequantized at a time where a tensor is quantized again
Q8_0_BLOCK = 34  # bytes: d (fp16), 32 int8 values
Q6_K_BLOCK = 210  # bytes: 128 of low nibbles, 64 of top two bits, int8 sc [16], d (fp16)


def _scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's ``get_scale_min_k4`` for all eight sub-blocks: [B, 12] -> two [B, 8]."""
    s = packed.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), dtype=np.uint8)
    m = np.empty_like(sc)
    sc[:, :4] = s[:, 0:4] & 63
    m[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    m[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, m


def _k_steps(blocks: np.ndarray, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """A k-quant tensor's d and dmin (fp16) and its 6-bit codes as 8-bit ones (m negated:
    w = d * sc * q + dmin * -m), as ``Int4Blocks``' fields."""
    supers, groups = cols // 256, cols // 32
    sc, m = _scales_and_mins(blocks[:, 4:16])
    return {
        "d": torch.from_numpy(blocks[:, 0:2].copy().view(np.float16).reshape(rows, supers)),
        "m_step": torch.from_numpy(blocks[:, 2:4].copy().view(np.float16).reshape(rows, supers)),
        "sc": torch.from_numpy(sc.reshape(rows, groups)),
        "m": torch.from_numpy(-m.reshape(rows, groups).astype(np.int8)),
    }


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A block's 128 bytes of nibbles as its 256 values: four chunks of 64, each 32 bytes' low
    nibbles, then their high ones. [B, 128] -> [B, 4, 2, 32]."""
    chunks = qs.reshape(-1, 4, 32)
    return np.stack([chunks & 0xF, chunks >> 4], axis=2)


def q4_k_weight(raw: np.ndarray, rows: int, cols: int) -> Int4Blocks:
    """A Q4_K tensor's bytes ([rows, cols / 256 * 144]) as ``Int4Blocks`` [rows, cols]."""
    blocks = np.ascontiguousarray(raw).reshape(-1, Q4_K_BLOCK)
    q = _nibbles(blocks[:, 16:]).reshape(rows, cols)
    return Int4Blocks(torch.from_numpy(q.astype(np.uint8)), **_k_steps(blocks, rows, cols))


def q5_k_weight(raw: np.ndarray, rows: int, cols: int) -> Int6Blocks:
    """A Q5_K tensor's bytes ([rows, cols / 256 * 176]) as ``Int6Blocks`` [rows, cols]: Q4_K's
    steps and nibbles, value i of a 64-value chunk j taking its fifth bit from bit 2j (first 32)
    or 2j + 1 (last 32) of byte i % 32 of the 32 bytes of fifth bits (``dequantize_row_q5_K``)."""
    blocks = np.ascontiguousarray(raw).reshape(-1, Q5_K_BLOCK)
    fifth = blocks[:, 16:48][:, None, None, :] >> np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
    q = (_nibbles(blocks[:, 48:]) | (fifth & 1) << 4).reshape(rows, cols)
    return Int6Blocks(torch.from_numpy(q.astype(np.uint8)), **_k_steps(blocks, rows, cols))


def q6_k_weight(raw: np.ndarray, rows: int, cols: int) -> Q6KBlocks:
    """A Q6_K tensor's bytes ([rows, cols / 256 * 210]) as ``Q6KBlocks`` [rows, cols]: a block's
    values in two halves of 128, each 64 bytes' low nibbles then their high ones, and 32 bytes
    of top bits, shifted by 0, 2, 4, 6 for its four runs of 32 (``dequantize_row_q6_K``)."""
    blocks = np.ascontiguousarray(raw).reshape(-1, Q6_K_BLOCK)
    low = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    top = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    q = (low & 15).reshape(-1, 256) | ((top & 3) << 4).reshape(-1, 256)
    return Q6KBlocks(
        torch.from_numpy(q.reshape(rows, cols)),
        torch.from_numpy(blocks[:, 208:210].copy().view(np.float16).reshape(rows, cols // 256)),
        torch.from_numpy(blocks[:, 192:208].copy().view(np.int8).reshape(rows, cols // 16)),
    )


def q8_0_weight(raw: np.ndarray, rows: int, cols: int) -> Int8Weight:
    """A Q8_0 tensor's bytes ([rows, cols / 32 * 34]) as a grouped ``Int8Weight`` [rows, cols]."""
    # torch's copy of the strided columns: numpy's, 32 bytes a row, took 4x as long (an
    # embedding table of 262k rows: seconds)
    blocks = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1, Q8_0_BLOCK))
    d = blocks[:, 0:2].contiguous().view(torch.float16)  # [B, 1]
    q = blocks[:, 2:].contiguous().view(torch.int8)
    return Int8Weight(q.reshape(rows, cols), d.reshape(rows, cols // 32))


def unpermute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's query/key row permutation (transformers' ``_reverse_permute_weights``)."""
    dim = t.shape[0] // heads // 2
    return t.reshape(heads, dim, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


class GGUFTensors:
    """The file's tensors by name (``gguf``'s reader), each read from the file as it is asked for."""

    def __init__(self, path: str, num_heads: int, num_kv_heads: int, lean: bool = False):
        """``lean``: the model was loaded without the file's quantized weights
        (``worker/loading/gguf_model.py``); they are read from the file here."""
        import gguf

        self.lean, self.path = lean, path
        self.reader = GGUFFile.read(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        kinds = gguf.GGMLQuantizationType
        refused = sorted({t.tensor_type.name for t in self.reader.tensors} - SERVED_TYPES)
        if refused:
            raise UnsupportedGGUFType(path, refused)
        # Each form's readers by the file's tensor type (gguf_blocks.py: which are exact).
        self.readers = {
            "int4": {kinds.Q4_K: q4_k_weight, kinds.Q4_1: q4_1_weight},
            "int6": {
                kinds.Q5_K: q5_k_weight,
                kinds.Q4_K: q4_k_weight,
                kinds.Q5_1: q5_1_weight,
                kinds.Q4_1: q4_1_weight,
            },
            "q6k": {kinds.Q6_K: q6_k_weight, kinds.Q3_K: q3_k_weight},
            "int8": {
                kinds.Q8_0: q8_0_weight,
                kinds.Q4_0: q4_0_weight,
                kinds.Q5_0: q5_0_weight,
                kinds.IQ4_NL: iq4_nl_weight,
                kinds.IQ4_XS: iq4_xs_weight,
            },
        }
        self.inexact = {kinds.IQ4_XS}  # its scales rounded to float16 (gguf_blocks.py)
        # d and m per 32 values (Int4Groups), not k-quant blocks: one projection holds one kind
        self.groups_types = {kinds.Q4_1, kinds.Q5_1}
        self.floats_types = {kinds[name] for name in FLOAT_TYPES}
        architecture = self.reader.value("general.architecture")
        # Only llama.cpp's "llama" files (Llama, Mistral) hold permuted query and key rows.
        permuted = architecture == "llama"
        self.heads = {"attn_q": num_heads, "attn_k": num_kv_heads} if permuted else {}

    def permuted_heads(self, name: str) -> int | None:
        """The heads whose rows the tensor ``name`` holds in llama.cpp's rotary order; None
        where its rows are in transformers' order."""
        return self.heads.get(name.split(".")[-2])

    def data(self, tensor) -> np.ndarray:
        """The tensor's data read from the file, as ``gguf``'s ``ReaderTensor.data`` holds it
        (``GGUFFile.read_tensor``: not a mapping, whose pages raised the build's peak RSS)."""
        return self.reader.read_tensor(tensor)

    def int4(self, name: str) -> Int4Blocks | Int4Groups | None:
        """The tensor exactly as ``Int4Blocks`` where it is Q4_K, ``Int4Groups`` where Q4_1;
        None otherwise."""
        return self._read(name, self.readers["int4"])

    def int6(self, name: str) -> Int6Blocks | Int6Groups | None:
        """The tensor exactly as ``Int6Blocks`` where it is Q5_K or Q4_K, ``Int6Groups`` where
        Q5_1 or Q4_1; None otherwise."""
        weight = self._read(name, self.readers["int6"])
        if weight is None or isinstance(weight, (Int6Blocks, Int6Groups)):
            return weight
        kind = Int6Groups if isinstance(weight, Int4Groups) else Int6Blocks
        return kind(*(getattr(weight, f) for f in _row_fields(weight)))

    def q6k(self, name: str) -> Q6KBlocks | None:
        """The tensor as exact ``Q6KBlocks`` where it is Q6_K or Q3_K; None otherwise."""
        return self._read(name, self.readers["q6k"])

    def int8(self, name: str) -> Int8Weight | None:
        """The tensor as a grouped ``Int8Weight`` where it is Q8_0, Q4_0, Q5_0, IQ4_NL (exact)
        or IQ4_XS; None otherwise."""
        return self._read(name, self.readers["int8"])

    def held(self, name: str):
        """The tensor in the first form (int4, 6-bit, Q6_K, int8) whose readers take its type,
        as a projection of it alone holds it on llmq's kernels; None where none does."""
        tensor_type = self.tensors[name].tensor_type
        forms = ("int4", "int6", "q6k", "int8")
        form = next((f for f in forms if tensor_type in self.readers[f]), None)
        return None if form is None else self._read(name, self.readers[form])

    def _read(self, name: str, readers: dict):
        tensor = self.tensors.get(name)
        reader = None if tensor is None else readers.get(tensor.tensor_type)
        if reader is None:
            return None
        cols, rows = (int(n) for n in tensor.shape[:2])  # GGUF lists the fastest dimension first
        weight = reader(self.data(tensor), rows, cols)
        heads = self.permuted_heads(name)
        if heads is None:
            return weight
        return dataclasses.replace(
            weight, **{f: unpermute_rows(getattr(weight, f), heads) for f in _row_fields(weight)}
        )

    def linear(self, names: list[str], plain_weight, bias) -> QuantizedLinear | None:
        """One fused projection of the tensors ``names``: None (kept float) where all are float
        tensors; int4 where all are Q4_K or all Q4_1, 6-bit where all are Q4_K or Q5_K, or all
        Q4_1 or Q5_1, or all Q6_K or Q3_K (on llmq's kernel), int8 from the file's blocks where
        all are Q8_0, Q4_0, Q5_0, IQ4_NL or IQ4_XS, else int8 from the (dequantized) fused float
        weight."""
        types = [getattr(self.tensors.get(name), "tensor_type", None) for name in names]
        if names and all(t in self.floats_types for t in types):
            return None  # the model's float weights, in its dtype
        one_kind = len({t in self.groups_types for t in types}) == 1
        forms = [("int4", self.int4, Int4Linear)]
        if int_kernel_available() and not plain_weight.is_cuda:
            forms += [("int6", self.int6, Int6Linear), ("q6k", self.q6k, Q6KLinear)]
        for form, read, linear in (*forms, ("int8", self.int8, Int8Linear)):
            # by the types first: a group's tensors are read only for a form that takes them all
            if not names or not one_kind or any(t not in self.readers[form] for t in types):
                continue
            parts = [read(name) for name in names]
            fused = dataclasses.replace(
                parts[0],
                **{f: torch.cat([getattr(p, f) for p in parts]) for f in _row_fields(parts[0])},
            )
            exact = not self.inexact.intersection(types)
            if self.lean or _same_weights(fused, plain_weight, exact):
                return linear(fused, bias)
            log.warning("%s: the file's blocks differ from the loaded weights; int8", names[0])
        if set(types) & self.floats_types:
            log.warning("%s: float and quantized tensors fused (%s); int8", names[0], types)
        if self.lean:  # the model holds none of the file's quantized weights
            plain_weight = torch.cat([self.floats(name, plain_weight.dtype) for name in names])
        return quantized_linear(plain_weight, bias, 8)

    def floats(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor as ``gguf``'s reader dequantizes it, in ``dtype`` (as transformers loads
        it), rows in transformers' order; float32 for a chunk of rows at a time only."""
        import gguf

        tensor = self.tensors[name]
        cols, rows = (int(n) for n in tensor.shape[:2])
        raw = self.data(tensor).reshape(rows, -1)
        out = torch.empty(rows, cols, dtype=dtype)
        for start in range(0, rows, FLOAT_ROWS):
            part = gguf.quants.dequantize(raw[start : start + FLOAT_ROWS], tensor.tensor_type)
            out[start : start + FLOAT_ROWS] = torch.from_numpy(part.reshape(-1, cols))
        heads = self.permuted_heads(name)
        return out if heads is None else unpermute_rows(out, heads)


def _row_fields(weight: Int4Blocks | Q6KBlocks | Int8Weight) -> list[str]:
    """The weight's tensors, each a row per output channel (q, its steps and codes)."""
    fields = dataclasses.fields(weight)
    return [f.name for f in fields if isinstance(getattr(weight, f.name), torch.Tensor)]


def _same_weights(
    weight: Int4Blocks | Q6KBlocks | Int8Weight, loaded: torch.Tensor, exact: bool = True
) -> bool:
    """Whether the blocks read here are the weights transformers loaded (its dequantized ones,
    in its row order), exact but for a bfloat16 model's rounding (``exact``; else within a
    tenth of their root mean square, a conversion's error being a hundredth of it): a check
    that the blocks map onto the right rows of an architecture, made once at load."""
    ours = weight.dequantize()
    if ours.shape != loaded.shape:
        return False
    if not exact:
        error = (ours - loaded.float()).square().mean().sqrt()
        return bool(error <= 0.1 * loaded.float().square().mean().sqrt())
    return bool(((ours - loaded.float()).abs() <= 2**-8 * ours.abs() + 1e-7).all())


class UnsupportedGGUFType(UnsupportedModel):
    """The file holds tensors of a type llmq does not read: the model is refused, by name."""

    def __init__(self, path: str, types: list[str]):
        super().__init__("GGUF", [f"tensors of type {', '.join(types)}"])
        served = ", ".join(sorted(SERVED_TYPES))
        self.args = (
            f"{path}: llmq does not serve GGUF tensors of type {', '.join(types)} "
            f"(it serves {served})",
        )


class GGUFQuantizer:
    """``quantize``'s quantizer for a model loaded from a GGUF file (``llmq_gguf_path`` on its
    config): each projection from the file's blocks."""

    def __init__(self, forward):
        config = forward.model.config
        lean = getattr(config, "llmq_gguf_lean", False)
        self.file = GGUFTensors(
            config.llmq_gguf_path, forward.num_heads, forward.num_kv_heads, lean
        )

    def linear(self, index: int, role: str, plain) -> QuantizedLinear | None:
        if index < 0:  # the head: its own tensor, or the embedding's where tied
            name = HEAD if HEAD in self.file.tensors else EMBEDDING
            names = [name]
        else:
            names = [f"blk.{index}.{t}.weight" for t in ROLE_TENSORS[role]]
        return self.file.linear(names, plain.weight, plain.bias)

    def embedding(
        self, table: torch.Tensor
    ) -> Int4Blocks | Int4Groups | Int6Blocks | Int6Groups | Q6KBlocks | Int8Weight | None:
        file = self.file
        if file.tensors[EMBEDDING].tensor_type in file.floats_types:
            return None  # the model's float table, as the file holds it
        exact = file.int4(EMBEDDING) or file.int6(EMBEDDING) or file.q6k(EMBEDDING)
        exact = exact or file.int8(EMBEDDING)
        if exact is not None:
            return exact
        return Int8Weight.quantize(file.floats(EMBEDDING, table.dtype) if file.lean else table)
