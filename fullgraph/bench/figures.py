"""The figure scaffolding the benchmark scripts share: a matplotlib ``Figure`` (never
pyplot) when matplotlib is installed, and saving it as a PNG with a Markdown link."""
from __future__ import annotations

from pathlib import Path
from typing import Any

NO_MATPLOTLIB = "(no plot: matplotlib is not installed; pip install 'fullgraph[plots]')"


def new_figure(width: float, height: float) -> Any | None:
    """A ``matplotlib.figure.Figure`` of that size in inches, or None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure(figsize=(width, height))


def save_figure(fig: Any, out: Path, alt: str) -> str:
    """Lay out and write ``fig`` to ``out`` (100 dpi); a Markdown image link to it, at
    ``out`` as given (``--plot docs/img/x.png`` run from the repository's root links
    where BENCHMARKS.md finds it)."""
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return f"![{alt}]({out.as_posix()})"
