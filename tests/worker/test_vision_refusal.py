"""Vision-language model folders of families llmq does not serve are refused by name: the
configuration class in the message, before any weight loads (a real worker's refusal is in
tests/api/test_vision_llava.py, beside the families served)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import Mistral3Config, MllamaConfig, PaliGemmaConfig

from llmq.worker.vision.families import UnservedVisionModel, refuse_unserved

CONFIGS = {
    "MllamaConfig": MllamaConfig,
    "Mistral3Config": Mistral3Config,
    "PaliGemmaConfig": PaliGemmaConfig,
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
