"""Vision-language model folders of families llmq does not serve are refused by name: the
configuration class in the message, before any weight loads; a real worker given one exits
non-zero with the reason logged (no traceback), and the API answers a 400
``model_not_supported`` naming it."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from transformers import Gemma3Config, Idefics3Config, LlavaConfig, Qwen2_5_VLConfig

from llmq.common.transport.redis_server import RedisServer
from llmq.worker.vision.families import UnservedVisionModel, refuse_unserved
from tests.harness import kill_all, start_api, start_worker

CONFIGS = {
    "LlavaConfig": LlavaConfig,
    "Qwen2_5_VLConfig": Qwen2_5_VLConfig,
    "Idefics3Config": Idefics3Config,
    "Gemma3Config": Gemma3Config,
}


def vision_folder(llama_dir: Path, out: Path, config_class) -> Path:
    """The test model's tokenizer beside a vision-language config.json (no weights: the
    refusal comes before any would load)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in llama_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    config_class().to_json_file(str(out / "config.json"))
    return out


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_vision_family_is_refused_by_its_config_class(llama_dir, tmp_path, name):
    folder = vision_folder(llama_dir, tmp_path / name, CONFIGS[name])
    with pytest.raises(UnservedVisionModel, match=f"{name} is a vision-language model"):
        refuse_unserved(str(folder))
    refuse_unserved(str(llama_dir))  # a text model passes


def test_a_worker_refuses_a_vision_model_by_name_and_exits(llama_dir, tmp_path):
    folder = vision_folder(llama_dir, tmp_path / "qwen-vl", Qwen2_5_VLConfig)
    with RedisServer() as server:
        worker = start_worker(server.url, folder, "w-vl", tmp_path, wait=False)
        api, base = start_api(server.url, str(folder), tmp_path, "api-vl")
        try:
            assert worker.proc.wait(120) != 0
            log = worker.log(20_000)
            assert "Qwen2_5_VLConfig is a vision-language model" in log
            assert "Traceback" not in log and "Unrecognized configuration" not in log, log
            body = {"model": str(folder), "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "model_not_supported" and "Qwen2_5_VLConfig" in error["message"]
        finally:
            kill_all([worker, api])
