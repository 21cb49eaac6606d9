"""The README's settings table, generated from the Settings class so it cannot drift:
`python -m llmq.tools.settings_doc` prints it (``--write README.md`` puts it there); a test
checks the README holds it."""

from __future__ import annotations

import sys
from pathlib import Path

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


def write(readme: Path) -> None:
    text = readme.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{settings_table()}\n{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write(Path(sys.argv[2] if len(sys.argv) > 2 else "README.md"))
    else:
        print(settings_table())
