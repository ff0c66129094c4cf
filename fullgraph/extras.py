"""Optional packages: each belongs to one extra of the distribution (pyproject.toml).

Code that needs one imports it through ``require``; when it is missing the user gets
one line naming the extra to install, e.g. ``pip install 'fullgraph[fast]'``.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from fullgraph.errors import FullgraphError

EXTRAS = {"numba": "fast", "torch_geometric": "pyg", "matplotlib": "plots"}
"""Importable module -> the extra of ``pip install 'fullgraph[EXTRA]'`` that brings it."""


class MissingExtraError(FullgraphError, ImportError):
    """An optional package a requested feature needs is not installed."""


def missing_message(module: str, purpose: str) -> str:
    """One line: what needs ``module`` and the pip command that installs it."""
    return (f"{purpose} needs {module}, which is not installed: "
            f"pip install 'fullgraph[{EXTRAS[module]}]'")


def require(module: str, purpose: str) -> ModuleType:
    """Import the optional ``module`` (a key of ``EXTRAS``) for ``purpose``.

    Raises:
        MissingExtraError: it is not installed; the message names the extra.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(missing_message(module, purpose)) from None
