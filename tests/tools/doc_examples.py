"""The code blocks of the README and of docs/, as the examples test runs them.

A fence names its language. A `python` block is an example; a `bash` (`sh`, `shell`,
`console`) block is one when it calls the server (curl, `llmq batch`, `llmq inspect`). A block
that cannot run against a test stack says why on the line right before its fence:
``<!-- example: skip (reason) -->``. Anything else (a shell block that calls no server and
carries no such line, a fence without a language, a marker that precedes no fence or says
something else) is an error, so that no example goes unchecked unnoticed."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,})(?P<lang>[^`\s]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<what>.*?)\s*-->\s*$")
SKIP = re.compile(r"^skip \((?P<reason>[^)]+)\)$")
CALLS_SERVER = re.compile(r"\bcurl\b|\bllmq\s+(batch|inspect)\b")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None  # the reason given by its marker

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def kind(self) -> str:
        """python, shell (calls the server), other (not an example) or unknown."""
        if self.lang in PYTHON:
            return "python"
        if self.lang in SHELL:
            return "shell" if CALLS_SERVER.search(self.code) else "unknown"
        return "other" if self.lang else "unknown"


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of one Markdown file and the errors of its markers."""
    rel = str(path.relative_to(ROOT))
    lines = path.read_text().split("\n")
    blocks: list[Block] = []
    errors: list[str] = []
    i = 0
    while i < len(lines):
        marker = MARKER.match(lines[i])
        fence = FENCE.match(lines[i])
        if marker:
            skip = SKIP.match(marker.group("what"))
            if not skip:
                errors.append(f"{rel}:{i + 1}: write <!-- example: skip (reason) -->")
            if i + 1 >= len(lines) or not FENCE.match(lines[i + 1]):
                errors.append(f"{rel}:{i + 1}: the marker must be right before a fence")
        elif fence:
            end = _closing(lines, i, fence)
            if end is None:
                errors.append(f"{rel}:{i + 1}: the fence is never closed")
                break
            before = MARKER.match(lines[i - 1]) if i else None
            skip = SKIP.match(before.group("what")) if before else None
            indent = len(fence.group("indent"))
            code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            reason = skip.group("reason") if skip else None
            blocks.append(Block(rel, i + 1, fence.group("lang"), code, reason))
            i = end
        i += 1
    return blocks, errors


def _closing(lines: list[str], start: int, fence: re.Match) -> int | None:
    ticks = fence.group("ticks")
    for j in range(start + 1, len(lines)):
        if lines[j].strip() == ticks:
            return j
    return None


def collect() -> tuple[list[Block], list[str]]:
    """Every block of the README and docs/, and every error: bad markers, and blocks that are
    neither examples, nor skipped with a reason, nor of another language."""
    blocks: list[Block] = []
    errors: list[str] = []
    for path in markdown_files():
        found, bad = parse(path)
        blocks += found
        errors += bad
    for b in blocks:
        if b.kind == "unknown" and b.skip is None:
            what = (
                "a fence without a language" if not b.lang else "a shell block that calls no server"
            )
            errors.append(f"{b.id}: {what}: mark it <!-- example: skip (reason) --> or fix it")
        if b.skip is not None and b.kind == "other":
            errors.append(f"{b.id}: a skip marker on a {b.lang!r} block, which never runs")
    return blocks, errors


def runnable(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.skip is None and b.kind in ("python", "shell")]


def summary(blocks: list[Block]) -> str:
    """How many examples run, and how many are skipped by reason."""
    run = runnable(blocks)
    skipped: dict[str, int] = {}
    for b in blocks:
        if b.skip is not None:
            skipped[b.skip] = skipped.get(b.skip, 0) + 1
    kinds = {k: sum(b.kind == k for b in run) for k in ("python", "shell")}
    lines = [f"{len(run)} examples run ({kinds['python']} python, {kinds['shell']} shell)"]
    lines.append(f"{sum(skipped.values())} skipped:")
    lines += [f"  {n} x {reason}" for reason, n in sorted(skipped.items())]
    return "\n".join(lines)
