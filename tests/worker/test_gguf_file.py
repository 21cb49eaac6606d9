"""llmq's GGUF header reader (``common/gguf_file.py``) against ``gguf``'s ``GGUFReader``: the
same values for every key (each value type, arrays of them, an array of arrays), the same
tensor table and data; and the config built from it is transformers' own for the file, with or
without a vocabulary size among its hyperparameters."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3TextConfig

from llmq.common.gguf_file import GGUFFile
from llmq.worker.loading.gguf_model import gguf_config, gguf_read_once
from tests.worker.gguf_writer import source_config, write_gguf

gguf = pytest.importorskip("gguf")


def assert_read_as_gguf_reads(path: Path) -> None:
    ours, theirs = GGUFFile.read(path), gguf.GGUFReader(str(path))
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.types) == list(fields)
    for key, field in fields.items():
        value = ours.value(key)
        assert value == field.contents() and type(value) is type(field.contents()), key
        assert list(ours.types[key]) == field.types, key
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, their in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_bytes) == (
            their.name,
            their.tensor_type,
            their.n_bytes,
        )
        assert (mine.shape, mine.data_offset) == (tuple(map(int, their.shape)), their.data_offset)
        data = ours.read_tensor(mine)
        assert data.dtype == their.data.dtype and np.array_equal(data, their.data), mine.name


def test_every_value_type_reads_as_gguf_reads_it(tmp_path):
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("k.u8", 200)
    w.add_int8("k.i8", -100)
    w.add_uint16("k.u16", 60000)
    w.add_int16("k.i16", -30000)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -2_000_000_000)
    w.add_float32("k.f32", 0.1)
    w.add_uint64("k.u64", 2**63 + 5)
    w.add_int64("k.i64", -(2**62))
    w.add_float64("k.f64", 0.1)
    w.add_bool("k.bool", True)
    w.add_string("k.str", "ünï 日本")
    w.add_array("k.ints", [1, -2, 3])
    w.add_array("k.floats", [0.5, 0.25])
    w.add_array("k.strings", ["a", "", "日本", "b c"])
    w.add_array("k.bools", [True, False])
    w.add_array("k.empty", [])
    w.add_array("k.nested", [[1, 2], [3, 4]])
    w.add_custom_alignment(64)
    w.add_tensor("t.f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor(
        "t.q8",
        gguf.quants.quantize(np.ones((2, 64), np.float32), gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_read_as_gguf_reads(path)
    assert GGUFFile.read(path).count("k.strings") == 4


def test_a_model_file_reads_as_gguf_reads_it(gguf_dir):
    assert_read_as_gguf_reads(gguf_dir / "model-Q4_K_M.gguf")


def test_a_big_endian_file_is_refused_by_name(tmp_path):
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(ValueError, match="big-endian"):
        GGUFFile.read(path)


def gemma3_without_vocab_size(llama_dir: Path, tmp_path: Path) -> Path:
    """A small Gemma 3 text model as a GGUF file naming no vocabulary size (as llama.cpp's
    Gemma 3 files): its config takes the vocabulary's length."""
    source = tmp_path / "src"
    source.mkdir()
    config = source_config(llama_dir, source, Gemma3TextConfig, head_dim=64, sliding_window=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(source)
    out = write_gguf(source, tmp_path / "gemma3.gguf", {}, arch="gemma3", vocab_size=False)
    assert "gemma3.vocab_size" not in GGUFFile.read(out).types
    return out


def test_the_config_is_transformers_own(gguf_dir, llama_dir, tmp_path):
    for path in (gguf_dir / "model-Q4_K_M.gguf", gemma3_without_vocab_size(llama_dir, tmp_path)):
        with gguf_read_once():
            theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        ours = gguf_config(GGUFFile.read(path))
        assert ours.to_dict() == theirs.to_dict(), path.name
        assert ours.vocab_size == GGUFFile.read(path).count("tokenizer.ggml.tokens")
