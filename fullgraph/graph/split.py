"""Seeded train/validation/test splits.

Two schemes: per-class counts (the gnn-benchmark convention of Shchur et al.: 20
training and 30 validation vertices per class, the rest test) and fractions of all
labelled vertices. Both are deterministic for a given seed and ignore vertices whose
label is -1 (unlabelled).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fullgraph.errors import ValidationError


def per_class_split(labels: Tensor, num_classes: int, *, train_per_class: int = 20,
                    val_per_class: int = 30, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Masks with ``train_per_class`` / ``val_per_class`` vertices of each class, rest test.

    A class with fewer than ``train_per_class + val_per_class`` vertices gives all of
    them to train first, then to validation.

    Returns:
        (train_mask, val_mask, test_mask), each (N,) bool.
    """
    y = labels.cpu().numpy()
    rng = np.random.default_rng(seed)
    n = y.shape[0]
    train, val = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    for c in range(num_classes):
        members = np.flatnonzero(y == c)
        rng.shuffle(members)
        train[members[:train_per_class]] = True
        val[members[train_per_class:train_per_class + val_per_class]] = True
    test = (y >= 0) & ~train & ~val
    return torch.from_numpy(train), torch.from_numpy(val), torch.from_numpy(test)


def fraction_split(labels: Tensor, *, train: float = 0.6, val: float = 0.2,
                   seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Masks holding the given fractions of the labelled vertices (the rest is test).

    Raises:
        ValidationError: when the fractions are not in [0, 1] or sum above 1.
    """
    if not (0.0 < train <= 1.0 and 0.0 <= val <= 1.0 and train + val <= 1.0):
        raise ValidationError("split fractions must satisfy 0 < train, 0 <= val, train + val <= 1",
                              field="train/val", found=(train, val))
    y = labels.cpu().numpy()
    labelled = np.flatnonzero(y >= 0)
    perm = np.random.default_rng(seed).permutation(labelled)
    n_train = max(1, int(round(train * labelled.size)))
    n_val = int(round(val * labelled.size))
    masks = []
    for part in (perm[:n_train], perm[n_train:n_train + n_val], perm[n_train + n_val:]):
        m = np.zeros(y.shape[0], dtype=bool)
        m[part] = True
        masks.append(torch.from_numpy(m))
    return masks[0], masks[1], masks[2]
