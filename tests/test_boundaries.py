"""The house's shape: imports point one way (api -> common <- worker, tools above them), the API
app loads without torch, no function outgrows what a reader takes in at once, and a file past
the soft budget says why it is long."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "llmq"

# Layer -> the llmq layers it must never import (lazy imports inside functions included).
FORBIDDEN = {
    "common": ("api", "worker", "tools", "cli"),
    "api": ("worker", "tools", "cli"),
    "worker": ("api", "tools", "cli"),
}
# A soft budget: a longer file says why in its docstring ("Long because ...") instead of
# being split only to get under a cap, which leaves pairs of files that need each other's insides.
SOFT_FILE_LINES = 800
LONG_FILE_REASON = "Long because"
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _layer(path: Path, root: Path) -> str:
    parts = path.relative_to(root).parts
    return parts[0].removesuffix(".py") if parts else ""


def _imported(tree: ast.AST, path: Path, root: Path) -> list[tuple[int, str]]:
    """Every llmq module an ``import`` or ``from`` names, at any depth (relative ones resolved)."""
    package = ["llmq", *path.relative_to(root).parent.parts]
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            names.append((node.lineno, base))
            # `from llmq import api` names a layer in its alias, not its module
            names += [(node.lineno, f"{base}.{a.name}") for a in node.names if base == "llmq"]
    return [(line, n) for line, n in names if n == "llmq" or n.startswith("llmq.")]


def boundary_violations(root: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        layer = _layer(path, root)
        banned = FORBIDDEN.get(layer)
        if not banned:
            continue
        for line, name in _imported(ast.parse(path.read_text()), path, root):
            target = name.split(".")[1] if "." in name else ""
            if target in banned:
                found.append(f"{path.relative_to(root.parent)}:{line} ({layer}) imports {name}")
    return found


def test_imports_point_one_way():
    assert boundary_violations() == []


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: a lazy import inside a function, a relative import and a `from llmq
    import worker` in common are all caught (a checker that finds nothing proves nothing)."""
    root = tmp_path / "llmq"
    (root / "common").mkdir(parents=True)
    (root / "api").mkdir()
    (root / "common" / "a.py").write_text("def f():\n    from llmq.worker.x import y\n")
    (root / "common" / "b.py").write_text("from ..api import app\n")
    (root / "common" / "c.py").write_text("from llmq import worker\n")
    (root / "api" / "d.py").write_text("import llmq.common.x\nimport llmq.worker.engine\n")
    found = boundary_violations(root)
    assert [f.split(" ")[0] for f in found] == [
        "llmq/api/d.py:2",
        "llmq/common/a.py:2",
        "llmq/common/b.py:1",
        "llmq/common/c.py:1",
    ]


def test_api_app_imports_without_torch():
    code = (
        "import sys\n"
        "import llmq.api.app\n"
        "app = llmq.api.app.create_app()\n"
        "heavy = sorted(m for m in ('torch', 'llmq.worker') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "", f"importing the API app loaded {out.stdout.strip()}"


def test_files_and_functions_stay_small():
    too_long = []
    for path in _modules():
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        tree, lines = ast.parse(text), text.count("\n")
        if lines > SOFT_FILE_LINES and LONG_FILE_REASON not in (ast.get_docstring(tree) or ""):
            too_long.append(f"{name}: {lines} lines, and its docstring does not say why")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}(): {length} lines")
    assert too_long == []
