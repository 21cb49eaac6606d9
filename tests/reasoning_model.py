"""A copy of a test model made a reasoning model: <think> and </think> are tokens of its own
(added, not special, as Qwen3's), and its chat template opens the think block in the generation
prompt unless enable_thinking is false, and reads reasoning_effort."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# As Qwen3's template: the assistant turn opens <think> (enable_thinking false: an empty
# block, closed); reasoning_effort shows in a system line of its own.
REASONING_TEMPLATE = """
{%- if reasoning_effort is defined and reasoning_effort %}<|im_start|>system
Reasoning effort: {{ reasoning_effort }}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


def as_reasoning_model(model: Path, path: Path) -> Path:
    """``model`` copied to ``path`` with the think tokens (the embeddings grown for them) and
    REASONING_TEMPLATE as its chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(model, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"], special_tokens=False)
    weights = AutoModelForCausalLM.from_pretrained(path)
    weights.resize_token_embeddings(len(tokenizer))
    weights.save_pretrained(path)
    tokenizer.save_pretrained(path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = REASONING_TEMPLATE
    config_path.write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path
