"""Fixtures shared by the whole test suite."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shared_datasets() -> Path:
    """The offline real datasets (``<repo>/../shared/datasets``); skips when absent.

    The environment variable ``FULLGRAPH_SHARED_DATASETS`` overrides the location.
    """
    override = os.environ.get("FULLGRAPH_SHARED_DATASETS")
    path = Path(override) if override else (REPO_ROOT / ".." / "shared" / "datasets").resolve()
    if not path.is_dir():
        pytest.skip(f"shared datasets not found at {path} (set FULLGRAPH_SHARED_DATASETS)")
    return path
