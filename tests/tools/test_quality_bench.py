"""bench/quality.py: its command answers --help, and it cuts and scores the text as
llama-perplexity does (chunks of --ctx tokens each opened by the BOS where the model adds one,
the second half of each scored)."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import real_models

BENCH = Path(__file__).resolve().parent.parent.parent / "bench" / "quality.py"


def bench():
    spec = importlib.util.spec_from_file_location("quality_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help():
    out = subprocess.run(
        [sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "--models" in out.stdout and "--no-llama-cpp" in out.stdout


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])  # not fast: real models
def test_chunks_and_scored_positions_as_llama_perplexity(model):
    from transformers import AutoTokenizer

    q = bench()
    gguf = real_models.smollm2_gguf() if model == "smollm2" else real_models.gemma3_gguf()
    tok = AutoTokenizer.from_pretrained(real_models.float_folder(gguf))
    ids = tok(q.TEXT.read_text())["input_ids"]
    contexts = q.chunks(tok, 512, None)
    assert len(contexts) == len(ids) // 512 >= 2  # llama-perplexity needs two
    for i, c in enumerate(contexts):
        assert c[1:] == ids[i * 512 + 1 : (i + 1) * 512]
        # Gemma's tokenizer adds a BOS: every chunk opens with it; SmolLM2's adds none.
        assert c[0] == (tok.bos_token_id if model == "gemma3" else ids[i * 512])
    targets = q.targets_of(contexts)
    assert targets.tolist() == [t for c in contexts for t in c[257:512]]


@pytest.mark.unit
def test_compare_counts_disagreement_kl_and_perplexity():
    q = bench()
    ref = torch.randn(6, 10).log_softmax(-1)
    targets = torch.arange(6)
    same = q.compare(ref, ref, targets)
    assert same["top1"] == 0 and abs(same["kl"]) < 1e-6
    assert math.isclose(same["ppl"], math.exp(-float(ref[torch.arange(6), targets].mean())))
    flipped = ref.clone()
    flipped[0, ref[0].argmax()] = -100.0  # the first row's choice taken away
    moved = q.compare(ref, flipped.log_softmax(-1), targets)
    assert moved["top1"] == pytest.approx(1 / 6) and moved["kl"] > 0
