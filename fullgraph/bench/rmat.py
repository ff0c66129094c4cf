"""The R-MAT graphs the benchmark scripts train on, generated once into a cache."""
from __future__ import annotations

from pathlib import Path


def cached_rmat(cache: str | Path, vertices: int, edges: int, features: int, classes: int,
                seed: int) -> Path:
    """A symmetrised R-MAT dataset (``edges`` after symmetrisation), saved under
    ``cache`` the first time these parameters are asked for; its directory."""
    from fullgraph.graph import store, synthetic

    where = Path(cache) / f"rmat-{vertices}-{edges}-{features}-{classes}-{seed}"
    if not store.is_cached(where):  # streamed: the same files as rmat() + save_dataset
        synthetic.write_rmat(where, vertices, edges // 2, seed=seed, num_features=features,
                             num_classes=classes, symmetrize=True)
    return where
