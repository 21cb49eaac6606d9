"""The documentation site builds with every warning an error (a broken link, an anchor that
does not exist, a page left out of the navigation), and the README stays a page or two whose
links all lead somewhere."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def build(site_root: Path, out: Path) -> subprocess.CompletedProcess:
    """`mkdocs build --strict` of the site at ``site_root`` into ``out`` (never with -q: a quiet
    build counts no warnings, so strict mode passes whatever is broken)."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=site_root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_site_builds_strict(tmp_path):
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


@pytest.mark.parametrize(
    "broken",
    [
        "[a page that is not there](nowhere.md)",
        "[an anchor that is not there](faults.md#nowhere)",
    ],
)
def test_a_broken_link_fails_the_build(tmp_path, broken):
    """The strict build is what catches a broken link: checked on a copy of the site."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + f"\n{broken}\n")
    result = build(tmp_path, tmp_path / "site")
    assert result.returncode != 0
    assert "nowhere" in result.stdout + result.stderr


@pytest.mark.unit
def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


@pytest.mark.unit
def test_readme_links_lead_to_files():
    readme = (ROOT / "README.md").read_text()
    targets = [m.group("target") for m in LINK.finditer(readme)]
    local = [t.split("#", 1)[0] for t in targets if "://" not in t and not t.startswith("#")]
    assert local, "the README links into docs/"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert missing == [], f"README links to files that do not exist: {missing}"


@pytest.mark.unit
def test_readme_links_every_page():
    """A newcomer reaches every page of the site from the README in one click."""
    readme = (ROOT / "README.md").read_text()
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")}
    linked = {m.group("target").split("#", 1)[0] for m in LINK.finditer(readme)}
    assert pages - linked - {"docs/index.md"} == set()
