"""The commit-msg check (.githooks/commit-msg): the shape of a subject and a body, on messages
written to files as git hands them to the hook."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

HOOK = Path(__file__).resolve().parents[2] / ".githooks" / "commit-msg"
BODY = "\n\nThe why, the figures with their command, and the test.\n"


def check(tmp_path: Path, message: str) -> tuple[int, str]:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    done = subprocess.run([sys.executable, str(HOOK), str(path)], capture_output=True, text=True)
    return done.returncode, done.stderr


@pytest.mark.parametrize(
    "message",
    [
        "layout: break the import cycles" + BODY,
        "worker/runner: one plan decides the forward" + BODY,
        "docs, bench: the index of the benchmarks" + BODY + "# Please enter the commit message\n",
        "Merge branch 'main' of elsewhere\n",
        "fixup! layout: break the import cycles\n",
    ],
)
def test_accepted(tmp_path, message):
    assert check(tmp_path, message) == (0, "")


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        ("Break the import cycles" + BODY, "is not `area: imperative summary`"),
        ("layout: " + "x" * 70 + BODY, "subject is 78 characters"),
        ("layout: break the cycles\nno blank line\n", "not followed by a blank line"),
        ("layout: break the cycles\n", "no body"),
        ("# only a comment\n\n", "the message is empty"),
    ],
)
def test_refused(tmp_path, message, problem):
    code, stderr = check(tmp_path, message)
    assert code == 1 and problem in stderr, stderr
