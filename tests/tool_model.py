"""A copy of a test model whose chat template renders tools, calls and their results."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# A Hermes-style template (as Qwen2.5's): tools in the system turn, calls in <tool_call> tags,
# results as <tool_response>; it refuses arguments that are not a mapping.
TOOLS_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content or "" }}
{%- for call in message.tool_calls %}
{%- if call.function.arguments is not mapping %}{{ raise_exception("arguments must be a mapping") }}{% endif %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def with_tools_template(model: Path, path: Path) -> Path:
    """``model`` copied to ``path`` with TOOLS_TEMPLATE as its chat template."""
    shutil.copytree(model, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path
