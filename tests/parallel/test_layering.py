"""Strategies share code through shared modules, never by importing one another."""
from __future__ import annotations

import ast
from pathlib import Path

import fullgraph.parallel as parallel
from fullgraph.parallel.base import STRATEGIES

PARALLEL = Path(parallel.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def test_no_strategy_imports_another_strategy():
    modules = {f"fullgraph.parallel.{name}" for name in STRATEGIES}
    assert modules, "no strategies registered"
    for name in STRATEGIES:
        imports = imported_modules(PARALLEL / f"{name}.py")
        others = sorted((modules - {f"fullgraph.parallel.{name}"}) & imports)
        assert not others, f"strategy {name!r} imports {others}"
