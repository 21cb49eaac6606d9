"""LoRA adapters as the API checks and places them: PEFT folders read without torch, the
registry record, the adapter's root in the block-hash chain, its cost in placement and its
card in /v1/models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmq.common.engine_status import EngineStatus
from llmq.common.lora_adapters import (
    AdapterError,
    AdapterRecord,
    check_adapter,
    parse_lora_modules,
)
from llmq.common.placement.block_hashes import adapter_root, prompt_hashes
from llmq.common.placement.placer import ADAPTER_LOAD_TOKENS, _adapter_cost
from llmq.common.placement.policy import Candidate, choose
from llmq.common.serving.model_cards import find_model, model_list
from tests.lora_model import make_adapter

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def adapter(llama_dir, tmp_path_factory) -> Path:
    return make_adapter(llama_dir, tmp_path_factory.mktemp("lora") / "a", rank=8)


@pytest.fixture(scope="module")
def base(llama_dir) -> dict:
    return json.loads((llama_dir / "config.json").read_text())


def _copy(adapter: Path, tmp_path: Path, **config_changes) -> Path:
    out = tmp_path / "changed"
    shutil.copytree(adapter, out)
    config = json.loads((out / "adapter_config.json").read_text())
    config.update(config_changes)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def test_a_peft_adapter_is_read_with_its_rank_and_targets(adapter, base):
    info = check_adapter(str(adapter), base, max_rank=64)
    assert info.rank == 8
    assert set(info.targets) == {"q_proj", "k_proj", "v_proj", "o_proj"} | {
        "gate_proj",
        "up_proj",
        "down_proj",
    }


def test_a_rank_over_the_bound_is_refused(adapter, base):
    with pytest.raises(AdapterError, match="rank 8 exceeds LLMQ_MAX_LORA_RANK=4"):
        check_adapter(str(adapter), base, max_rank=4)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"lora_bias": True}, "lora_bias"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
        ({"target_modules": ".*proj"}, "regex"),
        ({"peft_type": "IA3"}, "IA3"),
        ({"r": 0}, "positive"),
    ],
)
def test_what_changes_the_arithmetic_is_refused_by_name(adapter, base, tmp_path, change, named):
    with pytest.raises(AdapterError, match=named):
        check_adapter(str(_copy(adapter, tmp_path, **change)), base, max_rank=64)


def test_weights_of_another_shape_are_refused(adapter, base):
    wider = {**base, "hidden_size": base["hidden_size"] * 2}
    with pytest.raises(AdapterError, match="the base model's is"):
        check_adapter(str(adapter), wider, max_rank=64)
    fewer = {**base, "num_hidden_layers": 1}
    with pytest.raises(AdapterError, match="the base model has 1"):
        check_adapter(str(adapter), fewer, max_rank=64)


def test_missing_and_corrupt_files_are_refused(adapter, base, tmp_path):
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        check_adapter(str(tmp_path / "nowhere"), base, 64)
    broken = _copy(adapter, tmp_path)
    (broken / "adapter_model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(AdapterError, match="not a safetensors file"):
        check_adapter(str(broken), base, 64)
    (broken / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        check_adapter(str(broken), base, 64)


def test_lora_modules_parse_and_refuse_a_malformed_item():
    assert parse_lora_modules(" a=/x/a , b=/y/b,") == [("a", "/x/a"), ("b", "/y/b")]
    assert parse_lora_modules("") == []
    with pytest.raises(AdapterError, match="not name=path"):
        parse_lora_modules("a=/x,b")


def test_records_round_trip_and_are_seen_by_their_owner_alone():
    rec = AdapterRecord("sql", "base", "/a", owner="t1", rank=8, created=5)
    assert AdapterRecord.from_json(rec.to_json()) == rec
    assert rec.visible_to("t1") and not rec.visible_to("t2")
    assert AdapterRecord("sql", "base", "/a").visible_to("anyone")


def test_an_adapter_roots_its_own_block_chain_the_same_in_every_process():
    tokens = list(range(64))
    base = prompt_hashes(tokens, 16)
    sql = prompt_hashes(tokens, 16, adapter_root("sql"))
    chat = prompt_hashes(tokens, 16, adapter_root("chat"))
    assert adapter_root("") == 0 and prompt_hashes(tokens, 16, 0) == base
    assert not set(base) & set(sql) and not set(sql) & set(chat)
    code = "from llmq.common.placement.block_hashes import adapter_root; print(adapter_root('sql'))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(other.stdout) == adapter_root("sql")  # str hashes are salted per process


def test_placement_prefers_the_worker_holding_the_adapter_unless_far_busier():
    holding = EngineStatus(worker="a", loras="x,sql")
    other = EngineStatus(worker="b", loras="x")
    assert _adapter_cost(holding, "sql") == 0 and _adapter_cost(other, "") == 0
    assert _adapter_cost(other, "sql") == ADAPTER_LOAD_TOKENS

    def pick(load_a: int) -> str:
        candidates = [
            Candidate("a", 0, load_a, _adapter_cost(holding, "sql")),
            Candidate("b", 0, 0, _adapter_cost(other, "sql")),
        ]
        return choose(candidates, 40, 16, load_weight=1.0).worker

    assert pick(load_a=100) == "a"
    assert pick(load_a=ADAPTER_LOAD_TOKENS + 100) == "b"


def test_adapters_are_listed_under_their_served_base():
    engines = [EngineStatus(model="base", kind="generate", started=100, max_model_len=512)]
    adapters = {
        "sql": AdapterRecord("sql", "base", "/a/sql", rank=8, created=200),
        "gone": AdapterRecord("gone", "not-served", "/a/gone"),
    }
    cards = {m.id: m for m in model_list(engines, adapters).data}
    assert set(cards) == {"base", "sql"}
    assert cards["sql"].parent == "base" and cards["sql"].root == "/a/sql"
    assert cards["sql"].max_model_len == 512 and cards["sql"].created == 200
    assert "parent" not in cards["base"].model_dump()
    assert find_model(engines, "sql", adapters).parent == "base"
