"""Reading PEFT LoRA folders: each projection's A and B as PEFT saved them, scaled alpha/r
(alpha/sqrt(r) with rsLoRA), placed in the slots' stacked weights; a config asking for more
than that arithmetic is refused, naming what it asks."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from llmq.worker.runner.lora.lora_slots import LoraSlots
from llmq.worker.runner.lora.lora_weights import BaseShape, LoraLoadError, load_adapter
from tests.lora_model import make_adapter

pytestmark = pytest.mark.unit

# The tiny test models: hidden 64, 4 query heads and 2 key/value heads of 16, MLP 128, 2 layers.
WIDTHS = {
    "q_proj": (64, 64),
    "k_proj": (32, 64),
    "v_proj": (32, 64),
    "o_proj": (64, 64),
    "gate_proj": (128, 64),
    "up_proj": (128, 64),
    "down_proj": (64, 128),
}
SHAPE = BaseShape(2, WIDTHS, frozenset(WIDTHS))


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-weights")
    return {
        "all": make_adapter(llama_dir, root / "all", rank=8, lora_alpha=24),
        "rs": make_adapter(llama_dir, root / "rs", rank=16, lora_alpha=8, use_rslora=True),
        "qv": make_adapter(llama_dir, root / "qv", rank=8, targets=["q_proj", "v_proj"]),
    }


def _peft(folder, layer: int, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = load_file(folder / "adapter_model.safetensors")
    group = "mlp" if part in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    key = f"base_model.model.model.layers.{layer}.{group}.{part}.lora_"
    return tensors[key + "A.weight"], tensors[key + "B.weight"]


def test_each_projection_s_a_and_b_as_peft_saved_them(adapters):
    adapter = load_adapter(adapters["all"], SHAPE, 64, torch.float32, "cpu")
    assert adapter.rank == 8 and adapter.scale == 24 / 8
    assert len(adapter.layers) == 2 and all(set(layer) == set(WIDTHS) for layer in adapter.layers)
    for layer in range(2):
        for part in WIDTHS:
            a, b = _peft(adapters["all"], layer, part)
            delta = adapter.layers[layer][part]
            assert torch.equal(delta.a, a) and torch.equal(delta.b, b)


def test_rslora_scales_by_the_square_root_of_the_rank(adapters):
    adapter = load_adapter(adapters["rs"], SHAPE, 64, torch.bfloat16, "cpu")
    assert adapter.scale == pytest.approx(8 / math.sqrt(16))
    assert adapter.layers[0]["gate_proj"].a.dtype == torch.bfloat16


def test_a_subset_of_targets_leaves_the_others_out(adapters):
    adapter = load_adapter(adapters["qv"], SHAPE, 64, torch.float32, "cpu")
    assert all(set(layer) == {"q_proj", "v_proj"} for layer in adapter.layers)


def test_slots_stack_a_per_part_and_b_transposed_by_columns(adapters):
    """In the slots, a fused projection's A holds each part's rows in its own block, and its B
    transposed each part's B in that part's columns (zero past the rank, and for a part the
    adapter does not target); a slot written again holds nothing of the adapter before."""
    slots = LoraSlots(SHAPE, 3, torch.float32, "cpu")
    qv = load_adapter(adapters["qv"], SHAPE, 64, torch.float32, "cpu")
    slots.put(1, qv)
    assert qv.slot == 1 and qv.layers == [] and set(slots.a) == {"qkv"}
    assert slots.columns["qkv"] == [(0, 64), (64, 32), (96, 32)]
    assert slots.bounds["qkv"] == [0, 64, 96, 128]
    a, bt = slots.a["qkv"][0, 1], slots.bt["qkv"][0, 1]
    assert a.shape == (24, 64) and bt.shape == (8, 128)
    peft_q, peft_v = _peft(adapters["qv"], 0, "q_proj"), _peft(adapters["qv"], 0, "v_proj")
    assert torch.equal(a[0:8], peft_q[0]) and torch.equal(bt[:, 0:64], peft_q[1].t())
    assert torch.equal(a[16:24], peft_v[0]) and torch.equal(bt[:, 96:128], peft_v[1].t())
    assert not a[8:16].any() and not bt[:, 64:96].any()  # k: nothing
    # A rank-16 adapter: every slot's room grows, what slot 1 holds moves with it.
    slots.put(0, load_adapter(adapters["rs"], SHAPE, 64, torch.float32, "cpu"))
    assert slots.rank["qkv"] == 16 and slots.a["qkv"].shape == (2, 3, 48, 64)
    assert torch.equal(slots.a["qkv"][0, 1, 32:40], peft_v[0])
    assert torch.equal(slots.bt["qkv"][0, 1, 0:8, 96:128], peft_v[1].t())
    assert not slots.a["qkv"][0, 1, 40:48].any() and not slots.bt["qkv"][0, 1, 8:].any()
    assert slots.scale_of[:2] == [8 / math.sqrt(16), 2.0] and slots.rank_of == [16, 8, 0]
    slots.put(1, load_adapter(adapters["all"], SHAPE, 64, torch.float32, "cpu"))
    peft_k = _peft(adapters["all"], 0, "k_proj")
    assert torch.equal(slots.a["qkv"][0, 1, 16:24], peft_k[0])
    assert not slots.a["qkv"][0, 1, 8:16].any()  # the first adapter's rank 8: padding


CONFIG_REFUSALS = {
    "use_dora": (True, "use_dora"),
    "bias": ("lora_only", "bias='lora_only'"),
    "rank_pattern": ({"q_proj": 4}, "rank_pattern"),
    "alpha_pattern": ({"q_proj": 4}, "alpha_pattern"),
    "modules_to_save": (["lm_head"], "modules_to_save"),
    "peft_type": ("IA3", "not a LoRA adapter"),
    "lora_alpha": ("big", "bad r or lora_alpha"),
}


@pytest.mark.parametrize("key", list(CONFIG_REFUSALS))
def test_configs_asking_for_more_are_refused(adapters, tmp_path, key):
    folder = tmp_path / key
    shutil.copytree(adapters["all"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    value, reason = CONFIG_REFUSALS[key]
    config[key] = value
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoraLoadError, match=reason.replace("(", r"\(")):
        load_adapter(folder, SHAPE, 64, torch.float32, "cpu")


def test_files_missing_or_unreadable_are_refused(adapters, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(adapters["all"], folder)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraLoadError, match="no adapter_model.safetensors"):
        load_adapter(folder, SHAPE, 64, torch.float32, "cpu")
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraLoadError, match="unreadable"):
        load_adapter(folder, SHAPE, 64, torch.float32, "cpu")
    (folder / "adapter_config.json").unlink()
    with pytest.raises(LoraLoadError, match="no adapter_config.json"):
        load_adapter(folder, SHAPE, 64, torch.float32, "cpu")


def test_rank_over_the_bound_and_parts_the_base_lacks(adapters):
    with pytest.raises(LoraLoadError, match="rank 8 is over this server's max_lora_rank 4"):
        load_adapter(adapters["all"], SHAPE, 4, torch.float32, "cpu")
    attention_only = BaseShape(2, WIDTHS, frozenset({"q_proj", "k_proj", "v_proj", "o_proj"}))
    with pytest.raises(LoraLoadError, match="which the base lacks"):
        load_adapter(adapters["all"], attention_only, 64, torch.float32, "cpu")
    one_layer = BaseShape(1, WIDTHS, frozenset(WIDTHS))
    with pytest.raises(LoraLoadError, match="targets layer 1; the base has 1"):
        load_adapter(adapters["all"], one_layer, 64, torch.float32, "cpu")
    wider = BaseShape(2, {**WIDTHS, "q_proj": (72, 64)}, frozenset(WIDTHS))
    with pytest.raises(LoraLoadError, match=r"q_proj: lora_A \(8, 64\) and lora_B \(64, 8\)"):
        load_adapter(adapters["all"], wider, 64, torch.float32, "cpu")
