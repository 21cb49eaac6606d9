"""The configuration page's settings table, generated from the Settings class so it cannot
drift: `python -m llmq.tools.settings_doc` prints it, ``--write [PAGE]`` puts it between the
page's markers (docs/configuration.md unless named); a test checks the page holds it."""

from __future__ import annotations

import sys
from pathlib import Path

from llmq.common.settings import Settings

BEGIN = "<!-- settings:begin -->"
END = "<!-- settings:end -->"
PAGE = Path("docs") / "configuration.md"


def _default(value: object) -> str:
    if value is None:
        return "unset"
    return '`""`' if value == "" else f"`{value}`"


def settings_table() -> str:
    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        rows.append(
            f"| `LLMQ_{name.upper()}` | {_default(field.default)} | {field.description or ''} |"
        )
    return "\n".join(rows)


def undocumented() -> list[str]:
    """Settings without a description: the page would show an empty row for them."""
    return [
        f"LLMQ_{name.upper()}"
        for name, field in Settings.model_fields.items()
        if not (field.description or "").strip()
    ]


def write(page: Path) -> None:
    text = page.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{BEGIN}\n{settings_table()}\n{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write(Path(sys.argv[2]) if len(sys.argv) > 2 else PAGE)
    else:
        print(settings_table())
