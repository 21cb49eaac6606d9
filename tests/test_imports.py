"""Imports among llmq's modules form no cycle (lazy and TYPE_CHECKING imports included), and no
module reaches into another module's private (underscore) names. A cycle means two files need
each other's insides: merge them, or move the shared piece where both can import it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "llmq"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _parse_all(root: Path) -> dict[str, tuple[Path, ast.Module]]:
    return {
        _module_name(p, root): (p, ast.parse(p.read_text())) for p in sorted(root.rglob("*.py"))
    }


def _resolve(name: str, modules: dict) -> str:
    """The deepest llmq module ``name`` names (``llmq.a.b.func`` -> ``llmq.a.b``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    parts = package[: len(package) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _imports_of(module: str, path: Path, tree: ast.Module, modules: dict) -> set[str]:
    """Every llmq module this one imports, at any depth: top, function-level, TYPE_CHECKING."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {_resolve(a.name, modules) for a in node.names if a.name.startswith("llmq")}
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, module, path.name == "__init__.py")
            if base != "llmq" and not base.startswith("llmq."):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else _resolve(base, modules))
    # Importing a.b.c runs a.b's __init__ first: a package above the target and not above
    # this module is imported too.
    own = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for target in list(found):
        parts = target.split(".")
        for depth in range(2, len(parts)):
            package = ".".join(parts[:depth])
            if package in modules and not (own == package or own.startswith(package + ".")):
                found.add(package)
    found.discard(module)
    found.discard("")
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = _parse_all(root)
    return {m: _imports_of(m, p, tree, modules) for m, (p, tree) in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's, iterative), each named
    by one cycle through it: ``a -> b -> a``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in on_stack), None)
            if nxt is not None and nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                continue
            if nxt is not None:
                low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(_one_cycle(sorted(group), graph))
    return sorted(groups)


def _one_cycle(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    members, first = set(group), group[0]
    paths = {first: [first]}
    frontier = [first]
    while frontier:
        nxt = []
        for node in frontier:
            for w in sorted(graph[node] & members):
                if w == first:
                    return paths[node] + [first]
                if w not in paths:
                    paths[w] = paths[node] + [w]
                    nxt.append(w)
        frontier = nxt
    return group


def _private_definitions(tree: ast.Module) -> set[str]:
    """Underscore names a module defines: functions, classes, methods, globals, self._attrs."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_uses(root: Path = PACKAGE) -> list[str]:
    """``from llmq.x import _name``, and ``obj._name`` where ``_name`` is defined only in another
    llmq module (a private of torch or the standard library is not llmq's to guard)."""
    modules = _parse_all(root)
    own = {m: _private_definitions(tree) for m, (_, tree) in modules.items()}
    everywhere = set().union(*own.values())
    found = []
    for module, (path, tree) in modules.items():
        where = path.relative_to(root.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = _from_base(node, module, path.name == "__init__.py")
                private = [a.name for a in node.names if a.name.startswith("_")]
                if base.startswith("llmq") and private and not private[0].startswith("__"):
                    found.append(f"{where}:{node.lineno} imports {base}.{private[0]}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
                receiver = node.value
                if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                    continue
                if node.attr in everywhere - own[module]:
                    found.append(f"{where}:{node.lineno} uses {ast.unparse(node)}")
    return sorted(found)


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_module_uses_another_modules_private_names():
    assert private_uses() == []


def test_the_checks_see_lazy_type_checking_and_private_uses(tmp_path):
    """The checkers themselves, on a made-up package: a cycle closed by a TYPE_CHECKING import and
    one closed by a lazy relative import and one closed by a package's __init__ are named; a private import and a private method called
    from another module are caught, a module's own privates and torch's are not."""
    root = tmp_path / "llmq"
    (root / "common").mkdir(parents=True)
    for folder in (root, root / "common"):
        (folder / "__init__.py").write_text("")
    files = {
        "common/a.py": "from llmq.common.b import f\n",
        "common/b.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llmq.common.a import A\n"
            "def f():\n    pass\n"
        ),
        "common/c.py": "from llmq.common.d import _hidden\nclass C:\n    def _own(self):\n        pass\n",
        "common/d.py": (
            "import torch\n_hidden = 1\ndef g(c):\n    from . import c as mod\n"
            "    torch._C\n    c._own()\n"
        ),
        "common/e.py": "class E:\n    def _mine(self):\n        pass\ndef h(e):\n    e._mine()\n",
        # importing pkg.sub runs pkg's __init__, which imports f back
        "common/f.py": "from llmq.common.pkg.sub import x\n",
        "common/pkg/__init__.py": "from llmq.common.f import x\n",
        "common/pkg/sub.py": "x = 1\n",
    }
    (root / "common" / "pkg").mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    assert import_cycles(import_graph(root)) == [
        ["llmq.common.a", "llmq.common.b", "llmq.common.a"],
        ["llmq.common.c", "llmq.common.d", "llmq.common.c"],
        ["llmq.common.f", "llmq.common.pkg", "llmq.common.f"],
    ]
    assert private_uses(root) == [
        "llmq/common/c.py:1 imports llmq.common.d._hidden",
        "llmq/common/d.py:6 uses c._own",
    ]
