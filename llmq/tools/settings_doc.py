"""The README's settings table, generated from the Settings class so it cannot drift:
`python -m llmq.tools.settings_doc` prints it; a test checks the README holds it."""

from __future__ import annotations

from llmq.common.settings import Settings

BEGIN = "<!-- settings:begin -->"
END = "<!-- settings:end -->"


def settings_table() -> str:
    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        default = field.default
        shown = "unset" if default is None else f"`{default}`"
        rows.append(f"| `LLMQ_{name.upper()}` | {shown} | {field.description or ''} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(settings_table())
