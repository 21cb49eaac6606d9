"""Every benchmark entry point under bench/ answers ``--help``: its imports resolve against
today's tree and its parser is built (a moved module or a renamed setting shows here, not on
the day someone runs the benchmark). One child process runs them all, so the scripts' imports
(torch among them) load once and nothing they set at import reaches the test process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"

DRIVER = """
import contextlib, io, json, runpy, sys
results = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    sys.path.insert(0, path.rsplit("/", 1)[0])
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        results[path] = "returned without printing its help"
    except SystemExit as exit_:
        text = out.getvalue()
        results[path] = "ok" if exit_.code in (0, None) and "usage:" in text else text[-300:]
    except Exception as exc:
        results[path] = f"{type(exc).__name__}: {exc}"
print(json.dumps(results))
"""


def entry_points() -> list[Path]:
    return sorted(p for p in BENCH.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def test_every_bench_entry_point_answers_help():
    scripts = entry_points()
    assert len(scripts) >= 30, scripts  # the glob found the benchmarks
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, *map(str, scripts)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {Path(k).name: v for k, v in results.items() if v != "ok"}
    assert failed == {}, failed


def test_the_index_lists_every_entry_point():
    index = (BENCH / "README.md").read_text()
    missing = [p.name for p in entry_points() if f"`{p.name}`" not in index]
    assert missing == [], f"bench/README.md does not list {missing}"
