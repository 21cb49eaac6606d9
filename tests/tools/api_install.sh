#!/usr/bin/env bash
# The API's install without torch: a fresh virtualenv gets `pip install .` of the committed tree
# (HEAD, no `worker` extra), then runs `llmq api --help` and builds the API app with torch
# absent. Needs PyPI; a minute or two, so it is run by hand, not by `make test`.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The committed tree (HEAD), unpacked apart: pip builds in the source tree and leaves build/.
mkdir -p "$work/src" && git -C "$repo" archive HEAD | tar -x -C "$work/src"
venv=$work/venv
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q "$work/src"
cd "$work"  # away from the checkout: the installed package is what runs
if "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "FAIL: torch was installed without the worker extra" >&2
  exit 1
fi
"$venv/bin/llmq" api --help >/dev/null
"$venv/bin/python" - <<'PY'
import sys

import llmq.api.app

llmq.api.app.create_app()
heavy = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m.startswith("llmq.worker"))
assert not heavy, f"the API app loaded {heavy[:5]}"
print("ok: `llmq api --help` runs and the API app builds without torch installed")
PY
