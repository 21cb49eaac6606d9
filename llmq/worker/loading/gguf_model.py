"""A GGUF file's model with its quantized tensors left in the file.

transformers' own GGUF loading dequantizes every tensor into the model (several times the file's
size in the worker's peak RSS: docs/performance.md, "Choices: memory"), and llmq's forward then
reads the file's blocks again for its kernels (``worker/runner/loaders/gguf_weights.py``). Here the
model is built from the file's config with its weights left uninitialized (memory never touched is
not resident), and only the file's float tensors (norms, biases) are read into it, through
transformers' own tensor processors and name map; the quantized ones are read by the forward's
quantizer from the file (``llmq_gguf_lean`` on the config says so).

Where that could go wrong, transformers loads the file whole instead: an architecture whose
tensor processor changes more than norms and llama's query/key row order, a quantized tensor
the quantizer does not read (a fused ``attn_qkv``, experts), or a weight the file's float
tensors leave unset.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from pathlib import Path

from llmq.common.gguf_file import GGUFFile

log = logging.getLogger(__name__)

# GGUF tensor names of a llama-style layer's fused projections, per llmq role: with the
# embedding table and the head, the tensors the forward's quantizer reads from the file
# (worker/runner/loaders/gguf_weights.py).
ROLE_TENSORS = {
    "qkv": ("attn_q", "attn_k", "attn_v"),
    "o": ("attn_output",),
    "gate_up": ("ffn_gate", "ffn_up"),
    "down": ("ffn_down",),
}
EMBEDDING, HEAD = "token_embd.weight", "output.weight"
# The GGUF tensor types llmq serves (worker/runner/loaders/gguf_weights.py: what each becomes); a file
# holding any other is refused, naming it.
FLOAT_TYPES = frozenset(("F32", "F16", "BF16"))
SERVED_TYPES = (
    FLOAT_TYPES
    | frozenset(("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
    | frozenset(("IQ4_NL", "IQ4_XS"))
)
QUANTIZER_TENSORS = frozenset(name for names in ROLE_TENSORS.values() for name in names)
# transformers' processors that leave quantized projections as they are but for llama's
# query/key rows, which the quantizer puts back itself (gguf_weights.unpermute_rows).
LEAN_PROCESSORS = frozenset(("TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor"))


@contextlib.contextmanager
def gguf_read_once():
    """While transformers reads GGUF files: one reader per file, and gguf's tensor name map
    built once per architecture and layer count. Where transformers loads a file whole, it
    parses its metadata again for its config and for its weights (Gemma 3's 262k-entry
    vocabulary each time); its ``get_gguf_hf_weights_map`` builds the same name map once per
    module of the model (397 for SmolLM2-135M), the lean load's too."""
    import gguf

    name_map, reader = gguf.get_tensor_name_map, gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.get_tensor_name_map = functools.lru_cache(maxsize=4)(name_map)
    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = name_map, reader


def float_dtype(reader, native_bfloat16: bool) -> str | None:
    """The dtype a file of float weights is served in: its own ("float32" for F32, and for
    F16, whose CPU matmuls are slow: float32 holds it exactly; "bfloat16" for BF16 where the
    CPU has it, float32 holding it exactly elsewhere); None where the file holds a quantized
    weight (served as its blocks, ``worker/runner/loaders/gguf_weights.py``)."""
    types = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    if not types <= FLOAT_TYPES:
        return None
    return "bfloat16" if types == {"BF16"} and native_bfloat16 else "float32"


def _read_by_quantizer(name: str) -> bool:
    parts = name.split(".")
    if name in (EMBEDDING, HEAD):
        return True
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in QUANTIZER_TENSORS


def load_gguf_model(
    folder: str, file: str, dtype, auto: bool = False, native_bfloat16: bool = False
):
    """The model of ``folder/file`` with its quantized tensors unread, or None where
    transformers must load it whole (see the module's docstring). A file of float weights
    (``llmq_gguf_float`` on the config) is served as a float folder: in its own dtype
    (``float_dtype``) where ``auto``."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights

    started = time.monotonic()
    reader = GGUFFile.read(Path(folder) / file)
    architecture = reader.value("general.architecture")
    processor_class = gguf_utils.TENSOR_PROCESSORS.get(architecture, gguf_utils.TensorProcessor)
    float_types = {gguf.GGMLQuantizationType[t] for t in ("F32", "F16", "BF16")}
    quantized = [t.name for t in reader.tensors if t.tensor_type not in float_types]
    if processor_class.__name__ not in LEAN_PROCESSORS or not all(
        map(_read_by_quantizer, quantized)
    ):
        return None
    own_dtype = float_dtype(reader, native_bfloat16)
    if own_dtype is not None and auto:
        dtype = getattr(torch, own_dtype)
        log.info("%s holds float weights: served in %s", file, own_dtype)
    config = gguf_config(reader)
    log.info("load phase: metadata and config of %s in %.2f s", file, time.monotonic() - started)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    processor = processor_class(config=config.to_dict())
    names = gguf_utils.get_gguf_hf_weights_map(model, processor)
    floats = [t for t in reader.tensors if t.tensor_type in float_types]
    filled = _fill(model, reader, floats, processor, names)
    deferred = {names.get(name) for name in quantized}
    unset = [n for n, _ in model.named_parameters() if n not in filled and n not in deferred]
    if unset:
        log.info("%s: %s not in the file's float tensors; loading it whole", file, unset[:3])
        return None
    model.config.llmq_gguf_lean = True
    model.config.llmq_gguf_float = own_dtype is not None
    return model


def gguf_config(reader: GGUFFile):
    """transformers' config of the file, as ``AutoConfig.from_pretrained(folder, gguf_file=...)``
    builds it, from the metadata read here: transformers' GGUF reader is handed the file's
    fields without the tokenizer's arrays (parsing a vocabulary value by value was most of a
    config's time: 262k strings for Gemma 3), the vocabulary's length standing in as
    ``<architecture>.vocab_size`` where the file has none (transformers takes it from there)."""
    import gguf
    from transformers import AutoConfig

    path = Path(reader.path)
    view = _MetadataView(_config_fields(reader), reader.tensors)
    original = gguf.GGUFReader

    def read(file, mode="r"):
        return view if Path(file) == path else original(file, mode)

    gguf.GGUFReader = read
    try:
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    finally:
        gguf.GGUFReader = original


class _MetadataView:
    """What transformers' config reader takes of a ``GGUFReader``: its fields and tensors."""

    def __init__(self, fields: dict, tensors: list):
        self.fields, self.tensors = fields, tensors


def _config_fields(reader: GGUFFile) -> dict:
    """The file's fields as ``GGUFReader`` builds them (a part per value), the tokenizer's
    arrays left out where the architecture's config takes its vocabulary size from a key."""
    import numpy as np
    from gguf import GGUFValueType, ReaderField
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    architecture = reader.value("general.architecture")
    vocab_key, tokens = f"{architecture}.vocab_size", "tokenizer.ggml.tokens"
    lean = "vocab_size" in GGUF_CONFIG_MAPPING.get(architecture, {})
    types = dict(reader.types)
    if lean and vocab_key not in types and tokens in types:
        types[vocab_key] = (GGUFValueType.UINT32,)
    fields = {}
    for key, kinds in types.items():
        if lean and key.startswith("tokenizer.") and kinds[0] == GGUFValueType.ARRAY:
            continue
        value = reader.count(tokens) if key not in reader.types else reader.value(key)
        values = value if kinds[0] == GGUFValueType.ARRAY else [value]
        if kinds[-1] == GGUFValueType.STRING:
            parts = [np.frombuffer(v.encode("utf-8"), np.uint8) for v in values]
        else:
            dtype = GGUFFile.numpy_dtype(kinds[-1])
            parts = [np.array([v], dtype=dtype) for v in values]
        fields[key] = ReaderField(0, key, parts, list(range(len(parts))), list(kinds))
    return fields


def _fill(model, reader: GGUFFile, tensors, processor, names: dict[str, str]) -> set[str]:
    """The model's parameters set from the file's float ``tensors`` as transformers' loader
    sets them (its processor, its name map); returns their names, none where a tensor does not
    fit its parameter (transformers' own load then reports it)."""
    import gguf
    import numpy as np
    import torch

    params = dict(model.named_parameters())
    parsed = {"config": processor.config, "tensors": {}}
    filled = set()
    with torch.no_grad():
        for tensor in tensors:
            weights = gguf.quants.dequantize(reader.read_tensor(tensor), tensor.tensor_type)
            done = processor.process(
                weights=weights,
                name=tensor.name,
                tensor_key_mapping=names,
                parsed_parameters=parsed,
            )
            target = params.get(names.get(done.name, ""))
            if target is None:
                continue
            values = torch.from_numpy(np.array(done.weights, dtype=np.float32))
            if values.numel() != target.numel():  # the config misreads the file: its loader says
                log.info("%s: %d values for %s", tensor.name, values.numel(), tuple(target.shape))
                return set()
            target.copy_(values.reshape(target.shape))
            filled.add(names[done.name])
    return filled
