"""The catalogue of models on demand: what a LLMQ_CATALOGUE names, Ollama's keep_alive values,
and the workers' resident records as the API reads them."""

from __future__ import annotations

import json

import pytest

from llmq.common.catalogue import (
    FOREVER,
    expires_at,
    fresh_residents,
    holders,
    keep_alive_seconds,
    scan,
)

pytestmark = pytest.mark.unit


def _folder(path, weights: int) -> None:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"x" * weights)
    (path / "tokenizer.json").write_bytes(b"y" * 1000)  # not counted: not weights


def test_scan_names_folders_gguf_files_and_directories(tmp_path):
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    _folder(shelf / "Qwen2-0.5B", 300)
    (shelf / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"g" * 50)
    (shelf / "notes.txt").write_text("not a model")
    _folder(tmp_path / "Other", 10)
    found = scan(f"{shelf}, {tmp_path / 'Other'},{tmp_path / 'missing'}")
    assert sorted(found) == ["other", "qwen2-0.5b", "smollm2-135m-instruct"]
    assert found["qwen2-0.5b"].size == 300 and found["smollm2-135m-instruct"].size == 50
    assert found["other"].source == str((tmp_path / "Other").resolve())


def test_scan_keeps_the_first_of_one_name(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "m.Q4_0.gguf").write_bytes(b"1")
    (tmp_path / "b" / "m.Q8_0.gguf").write_bytes(b"22")
    found = scan(f"{tmp_path / 'a'},{tmp_path / 'b'}")
    assert list(found) == ["m"] and found["m"].size == 1


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, 300.0),
        ("", 300.0),
        (0, 0.0),
        ("0", 0.0),
        (90, 90.0),
        ("10s", 10.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("500ms", 0.5),
        (-1, FOREVER),
        ("-1m", FOREVER),
        ("-5", FOREVER),
    ],
)
def test_keep_alive_as_ollama_reads_it(value, seconds):
    assert keep_alive_seconds(value, 300.0) == seconds


@pytest.mark.parametrize("value", ["5 minutes", "m5", "10x", "1h 30m"])
def test_keep_alive_that_is_no_duration_is_refused(value):
    with pytest.raises(ValueError, match="no duration"):
        keep_alive_seconds(value, 300.0)


def test_residents_of_live_workers_only():
    now = 1000.0
    raw = {
        b"w1": json.dumps(
            {"updated": now - 1, "models": {"a": {"expires_at": 1300.0}, "b": {"expires_at": None}}}
        ),
        b"w2": json.dumps({"updated": now - 2, "models": {"a": {"expires_at": 1200.0}}}),
        b"dead": json.dumps({"updated": now - 60, "models": {"c": {"expires_at": 1100.0}}}),
        b"junk": b"not json",
    }
    live = fresh_residents(raw, now)
    assert sorted(live) == ["w1", "w2"]
    assert holders(live, "a") == ["w1", "w2"] and holders(live, "c") == []
    assert expires_at(live, "a") == 1300.0  # the last worker to let it go
    assert expires_at(live, "b") is None  # running or kept for good
    assert expires_at(live, "c") is None  # held by no live worker
