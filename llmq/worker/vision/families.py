"""Vision-language model folders (a ``vision_config`` in config.json) of families llmq does
not serve are refused before their weights load, by their configuration class's name: the
worker records the refusal (``refusal.py``: the API answers 400 ``model_not_supported``) and
exits, instead of dying in AutoModelForCausalLM on a configuration it does not map."""

from __future__ import annotations

import json
import logging

from llmq.common.model_files import model_file
from llmq.worker.runner.forward.model_support import UnsupportedModel

log = logging.getLogger(__name__)

# model_type of the vision-language families served (each added with its test against
# transformers).
SERVED: frozenset[str] = frozenset({"llava", "llava_next", "idefics3", "qwen2_5_vl", "gemma3"})


class UnservedVisionModel(UnsupportedModel):
    """A vision-language model of a family llmq does not serve."""

    def __init__(self, model_type: str, config_class: str):
        super().__init__(model_type, [f"image input ({config_class})"])
        served = ", ".join(sorted(SERVED)) or "none yet"
        self.args = (
            f"llmq does not serve this {model_type} model: {config_class} is a vision-language "
            f"model of a family llmq does not serve (vision-language families served: {served})",
        )


def vision_model_type(model: str) -> str | None:
    """The model_type of ``model`` where its config.json has a vision tower, else None (a text
    model, a GGUF file, or a folder without config.json)."""
    path = model_file(model, "config.json") if not model.endswith(".gguf") else None
    if path is None:
        return None
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "vision_config" not in config:
        return None
    return str(config.get("model_type", "unknown"))


def config_class_name(model_type: str) -> str:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return CONFIG_MAPPING_NAMES.get(model_type, f"{model_type} configuration")


def served_vision(model: str) -> bool:
    return vision_model_type(model) in SERVED


def refuse_unserved(model: str) -> None:
    """Raise UnservedVisionModel for a vision-language model of a family not served."""
    model_type = vision_model_type(model)
    if model_type is not None and model_type not in SERVED:
        raise UnservedVisionModel(model_type, config_class_name(model_type))
