"""The user documentation (README.md, docs/*.md) stays inside the repository and current.

Users get the repository, nothing beside it: a link or path that leaves it (such as
``../shared/DESIGN.md``) is dead for them. Markdown links and backticked ``.md``
names must resolve to files in the repository, backticked ``fullgraph/...`` and
``tests/...`` paths must exist (a rename that forgets the docs fails here), and the
text is ASCII like the code.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
OUTSIDE = re.compile(r"(?<![\w.])\.\./")  # "../" at the start of a path


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(REPO)) for p in paths]


def _inside(target: str, doc: Path) -> bool:
    """Whether ``target`` (relative to ``doc`` or to the repository) names a file in it."""
    for base in (doc.parent, REPO):
        path = (base / target).resolve()
        if path.is_relative_to(REPO) and path.exists():
            return True
    return False


def test_architecture_and_contributing_pages_exist_and_readme_links_them() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for page in ("docs/architecture.md", "docs/contributing.md"):
        assert (REPO / page).is_file(), f"{page} is missing"
        assert f"]({page})" in readme, f"README.md does not link {page}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_no_path_leaves_the_repository(doc: Path) -> None:
    bad = [f"{doc.name}:{n}: {line.strip()}"
           for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
           if OUTSIDE.search(line)]
    assert not bad, "paths outside the repository:\n" + "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_links_and_named_files_resolve(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    targets = [t.split("#")[0] for t in LINK.findall(text)
               if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    for code in CODE.findall(text):
        token = code.split("::")[0].split()[0] if code.split() else ""
        if "<" in token or "*" in token:
            continue  # a pattern such as fullgraph/models/<name>.py
        if token.endswith(".md") or token.startswith(("fullgraph/", "tests/")):
            targets.append(token)
    dead = sorted({t for t in targets if t and not _inside(t, doc)})
    assert not dead, f"{doc.name} names files that are not in the repository: {dead}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_docs_are_ascii(doc: Path) -> None:
    bad = [f"{doc.name}:{n}: {line.strip()}"
           for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
           if not line.isascii()]
    assert not bad, "non-ASCII characters:\n" + "\n".join(bad)


# ------------------------------------------------------------------ the floors table
ALLOWED_UP = {("parallel/", "configfile.py")}
"""Imports that reach a higher floor by design, as the text above the table says."""


def _floor_rows() -> list[tuple[int, list[str], set[str]]]:
    """(floor, units, names in the third column) per row of the table in
    docs/architecture.md's "Packages, bottom up"; a unit is ``graph/``, ``cli.py`` or
    ``schedule/bins.py`` (a package inside one listed in the same row is part of it)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## Packages, bottom up"):]
    section = section[:section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        m = re.match(r"\| (\d+) \| (.*?) \| (.*) \|$", line)
        if m:
            names = [n for n in re.findall(r"`([\w/]+(?:\.py|/))`", m.group(2))
                     if (REPO / "fullgraph" / n).exists()]
            units = [n for n in names if not any(o != n and o.endswith("/") and n.startswith(o)
                                                 for o in names)]
            rows.append((int(m.group(1)), units, set(re.findall(r"`([\w/]+)`", m.group(3)))))
    return rows


def _unit(module: str, floors: dict[str, int]) -> str | None:
    """The table's unit of ``fullgraph.a.b.c``: the longest listed prefix."""
    parts = module.split(".")[1:]
    for k in range(len(parts), 0, -1):
        for name in ("/".join(parts[:k]) + ".py", "/".join(parts[:k]) + "/"):
            if name in floors:
                return name
    return None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every fullgraph module ``path`` imports, inside functions too."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "fullgraph":
            out += [(node.lineno, f"fullgraph.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fullgraph."):
            out.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("fullgraph.")]
    return out


def test_every_import_goes_to_the_same_floor_or_lower():
    """The floors table of docs/architecture.md is the import order of ``fullgraph/``:
    every module is on it, every import (inside functions too) goes to its own floor or
    lower, except ``ALLOWED_UP``, and each row's third column names exactly what the
    row's modules import from the other rows."""
    rows = _floor_rows()
    floors = {u: floor for floor, units, _ in rows for u in units}
    assert len(floors) > 20, floors
    unlisted, upward, columns = [], [], []
    imported: dict[str, set[str]] = {u: set() for u in floors}
    for path in sorted((REPO / "fullgraph").rglob("*.py")):
        rel = path.relative_to(REPO / "fullgraph")
        if rel.as_posix() == "__init__.py":
            continue
        me = _unit("fullgraph." + ".".join(rel.with_suffix("").parts), floors)
        if me is None:  # (a package of listed modules may have an __init__ of no imports)
            if rel.name != "__init__.py" or _imports(path):
                unlisted.append(rel.as_posix())
            continue
        for line, name in _imports(path):
            unit = _unit(name, floors)
            if unit is None or unit == me:
                continue
            imported[me].add(unit)
            if floors[unit] > floors[me] and (me, unit) not in ALLOWED_UP:
                upward.append(f"{rel}:{line} ({me}, floor {floors[me]}) imports {name} "
                              f"({unit}, floor {floors[unit]})")
    for _, units, listed in rows:
        got = {u.removesuffix(".py").removesuffix("/") for me in units for u in imported[me]
               if u not in units}
        if got != (listed - {"nothing"}):
            columns.append(f"{', '.join(units)}: the table says {sorted(listed)}, the code "
                           f"imports {sorted(got)}")
    assert not unlisted, f"modules on no floor of docs/architecture.md: {unlisted}"
    assert not upward, "imports of a higher floor:\n" + "\n".join(upward)
    assert not columns, "third column of the floors table:\n" + "\n".join(columns)
