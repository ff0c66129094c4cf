"""Vertex data (features, labels, masks) and the Dataset that pairs it with a Graph.

Features are stored float32 by default, or bf16/fp16 to halve host memory; compute
always casts the rows it uses to float32 (``VertexData.features_as``). Labels are
int64 class ids in ``[0, num_classes)``; -1 marks an unlabelled vertex, which must
not sit in any mask. The train, validation and test masks are disjoint boolean
vectors, and the train mask is not empty.

Shapes: N = number of vertices, F = feature dimension.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fullgraph.errors import ValidationError
from fullgraph.graph.csr import Graph
from fullgraph.graph.sparse import convert, csr, is_sparse, row_blocks, take_rows

FEATURE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MASK_NAMES = ("train_mask", "val_mask", "test_mask")


@dataclass
class VertexData:
    """Per-vertex tensors of a node-classification dataset.

    Attributes:
        features: (N, F) float32, bfloat16 or float16; dense, or a CSR tensor
            (``torch.sparse_csr``: sparse input features, see ``graph.sparse``).
        labels: (N,) int64 class ids, -1 for unlabelled vertices.
        train_mask, val_mask, test_mask: (N,) bool, pairwise disjoint.
        num_classes: number of classes C; every label in a mask is in ``[0, C)``.
        row_ids: None when ``features`` holds every vertex's row (N rows); else the
            (M,) ascending int64 ids of the vertices whose rows it holds, in order
            (a per-part shard, ``partition.shards``). Labels and masks cover all N.
    """

    features: Tensor
    labels: Tensor
    train_mask: Tensor
    val_mask: Tensor
    test_mask: Tensor
    num_classes: int
    row_ids: Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return int(self.labels.shape[0])

    def take_features(self, gids: Tensor) -> Tensor:
        """The feature rows of vertices ``gids`` (global ids), dense or CSR as stored.

        Raises:
            ValueError: ``features`` holds only some rows (a shard) and not all of these.
        """
        return take_rows(self.features, self.row_positions(gids))

    def row_positions(self, gids: Tensor) -> Tensor:
        """Where the rows of vertices ``gids`` are in ``features`` (ValueError as for
        ``take_features``)."""
        if self.row_ids is None:
            return gids
        ids = gids.to(torch.int64)
        if ids.numel() == 0:
            return ids
        pos = torch.searchsorted(self.row_ids, ids).clamp_(max=max(0, self.row_ids.numel() - 1))
        absent = self.row_ids.numel() == 0 or bool((self.row_ids[pos] != ids).any())
        if absent:
            missing = ids if self.row_ids.numel() == 0 else ids[self.row_ids[pos] != ids]
            raise ValueError(f"this shard holds the feature rows of {self.row_ids.numel()} "
                             f"vertices, not those of {missing.numel()} that are needed (first: "
                             f"vertex {int(missing[0])}); the plan needs more hops of "
                             "replicated rows than the shard was written with")
        return pos

    @property
    def num_features(self) -> int:
        return int(self.features.shape[1])

    def features_as(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Features in ``dtype`` (no copy when already stored so)."""
        if self.features.dtype == dtype:
            return self.features
        return convert(self.features, dtype, self.features.device)

    def with_feature_dtype(self, name: str) -> "VertexData":
        """A copy whose features are stored as ``name`` (float32, bfloat16 or float16)."""
        if name not in FEATURE_DTYPES:
            raise ValidationError("unknown feature storage dtype", field="feature_dtype",
                                  found=name, expected=" | ".join(FEATURE_DTYPES))
        source = self.features.values() if self.features.layout == torch.sparse_csr \
            else self.features
        if FEATURE_DTYPES[name] == torch.float16 and source.dtype != torch.float16 and \
                source.numel():  # (a reduction: no (N, F) mask beside a mapped matrix)
            big = max(float(source.amax()), -float(source.amin()))
            if math.isfinite(big) and big > float(torch.finfo(torch.float16).max):
                raise ValidationError("a feature value does not fit float16",
                                      field="features", found=f"{big:g}",
                                      expected="at most 65504 in magnitude",
                                      hint="use --feature-dtype bfloat16 or float32")
        x = convert(self.features, FEATURE_DTYPES[name], self.features.device)
        return dataclasses.replace(self, features=x)

    def row_normalized(self, low: float | None = None) -> "VertexData":
        """A copy whose feature rows are shifted to be non-negative and sum to 1.

        Rows are shifted by the global minimum when it is negative, and rows summing
        to less than 1 are left unscaled (as PyG's ``NormalizeFeatures``). ``low``: that
        minimum when ``features`` holds only some rows (a shard records the whole
        dataset's); default: the minimum of ``features``.
        """
        if is_sparse(self.features):
            f = self.features
            values = f.values().to(torch.float32)
            least = float(values.min()) if values.numel() else 0.0
            if low is not None:
                least = min(least, low)
            if least >= 0:  # zeros stay zeros
                ptr = f.crow_indices()
                rows = torch.repeat_interleave(torch.arange(f.shape[0]), ptr[1:] - ptr[:-1])
                sums = torch.zeros(f.shape[0]).index_add_(0, rows, values)
                values = values / sums.clamp(min=1.0)[rows]
                x = csr(ptr, f.col_indices(), values.to(f.dtype),
                        (int(f.shape[0]), int(f.shape[1])))
                return dataclasses.replace(self, features=x)
            dense = dataclasses.replace(self, features=self.features.to_dense())
            return dense.row_normalized(low)  # a negative minimum shifts every entry
        x = self.features.to(torch.float32)
        least = float(x.min()) if x.numel() else 0.0
        if low is not None:
            least = min(least, low)
        if least < 0:
            x = x - least
        x = x / x.sum(dim=1, keepdim=True).clamp(min=1.0)
        return dataclasses.replace(self, features=x.to(self.features.dtype))

    def require_training(self, source: str = "vertex data") -> None:
        """Refuse to train on data without training vertices (a dataset of unlabelled
        vertices is for ``predict``, which ``validate`` lets through).

        Raises:
            ValidationError: the train mask is empty.
        """
        if not bool(self.train_mask.any()):
            unlabelled = not bool((self.labels >= 0).any())
            raise ValidationError("the train mask is empty", source=source, field="train_mask",
                                  found="0 training vertices", expected="at least one",
                                  hint="no vertex has a label: every label is -1; such a "
                                  "dataset is for predict" if unlabelled else None)

    def validate(self, num_nodes: int, source: str = "vertex data") -> None:
        """Check shapes, finiteness, label range and mask consistency (an empty train
        mask is taken: ``require_training``).

        Raises:
            ValidationError: naming the field, what was found and what was expected.
        """
        x = self.features
        if x.dim() != 2:
            raise ValidationError("features must be a 2-D array", source=source,
                                  field="features", found=tuple(x.shape), expected="(N, F)")
        rows = num_nodes if self.row_ids is None else self.row_ids.numel()
        if x.shape[0] != rows:
            raise ValidationError("feature rows do not match the number of vertices"
                                  if self.row_ids is None else
                                  "feature rows do not match the row ids of a shard",
                                  source=source, field="features", found=x.shape[0],
                                  expected=rows)
        if x.dtype not in FEATURE_DTYPES.values():
            raise ValidationError("features must be floating point", source=source,
                                  field="features", found=x.dtype,
                                  expected=" | ".join(FEATURE_DTYPES))
        _check_finite(x, source)
        self._validate_labels(num_nodes, source)
        self._validate_masks(num_nodes, source)

    def _validate_labels(self, num_nodes: int, source: str) -> None:
        y = self.labels
        if y.dim() != 1 or y.shape[0] != num_nodes:
            raise ValidationError("labels need one entry per vertex", source=source,
                                  field="labels", found=tuple(y.shape), expected=(num_nodes,))
        if y.dtype != torch.int64:
            raise ValidationError("labels must be int64 class ids", source=source,
                                  field="labels", found=y.dtype)
        if self.num_classes < 1:
            raise ValidationError("there must be at least one class", source=source,
                                  field="num_classes", found=self.num_classes)
        bad = (y < -1) | (y >= self.num_classes)
        if bool(bad.any()):
            v = int(torch.nonzero(bad)[0])
            raise ValidationError("label out of range", source=source, field=f"labels[{v}]",
                                  found=int(y[v]), expected=f"0 <= label < {self.num_classes}")

    def _validate_masks(self, num_nodes: int, source: str) -> None:
        masks = [getattr(self, name) for name in MASK_NAMES]
        for name, m in zip(MASK_NAMES, masks):
            if m.dtype != torch.bool or m.shape != (num_nodes,):
                raise ValidationError("mask must be a boolean vector with one entry per vertex",
                                      source=source, field=name,
                                      found=f"{m.dtype} {tuple(m.shape)}",
                                      expected=f"torch.bool ({num_nodes},)")
            unlabelled = m & (self.labels < 0)
            if bool(unlabelled.any()):
                v = int(torch.nonzero(unlabelled)[0])
                raise ValidationError("a masked vertex has no label", source=source,
                                      field=f"{name}[{v}]", found="label -1",
                                      expected="a class id")
        for i in range(3):
            for j in range(i + 1, 3):
                both = masks[i] & masks[j]
                if bool(both.any()):
                    v = int(torch.nonzero(both)[0])
                    raise ValidationError("masks overlap", source=source,
                                          field=f"{MASK_NAMES[i]} & {MASK_NAMES[j]}",
                                          found=f"vertex {v} in both ({int(both.sum())} in all)",
                                          expected="disjoint train/val/test masks")


@dataclass
class Shard:
    """What one part of a sharded dataset holds (``fullgraph.partition.shards``).

    A part keeps the rows a data-parallel worker of its partition reads: its own
    vertices, and with ``hops`` = h the vertices up to h hops upstream of them
    (DepCache's replicated inputs). The graph keeps the in-edges of ``edge_rows``
    only (vertex ids stay global), the features the rows of ``VertexData.row_ids``.

    Attributes:
        part: which part this is; parts: how many there are.
        hops: h, the depth of the replicated neighbourhood (0: own rows only).
        part_of: (N,) int64 part of every vertex (the partition).
        in_degree: (N,) int64 in-degree of every vertex in the whole graph, not
            counting self-loops (for the edge norms).
        edge_rows: ascending ids of the vertices whose in-edges ``graph`` holds:
            the part's vertices and those up to h - 1 hops upstream.
        num_edges: edges of the whole graph.
        feature_min: least feature value of the whole dataset (row normalisation).
        fingerprint: digests of the whole dataset (``checkpoint.dataset_fingerprint``).
        normalized: whether the rows were row-normalised after loading (then with
            ``feature_min``, as the whole dataset's would be).
    """

    part: int
    parts: int
    hops: int
    part_of: Tensor
    in_degree: Tensor
    edge_rows: Tensor
    num_edges: int
    feature_min: float
    fingerprint: dict[str, Any] = field(default_factory=dict)
    normalized: bool = False

    def check_edge_rows(self, gids: Tensor, what: str) -> None:
        """Raise ValueError when some of ``gids`` lack their in-edges in this part."""
        ids = gids.to(torch.int64)
        if ids.numel() == 0:
            return
        pos = torch.searchsorted(self.edge_rows, ids).clamp_(
            max=max(0, self.edge_rows.numel() - 1))
        bad = ids if self.edge_rows.numel() == 0 else ids[self.edge_rows[pos] != ids]
        if bad.numel():
            raise ValueError(f"{what}: shard {self.part} of {self.parts} was written with "
                             f"{self.hops} hops and lacks the in-edges of {bad.numel()} "
                             f"vertices the plan computes (first: vertex {int(bad[0])}); "
                             "write the shards again with more --shard-hops")


@dataclass
class Dataset:
    """A graph and its vertex data, with a name and free-form provenance.

    Attributes:
        name: dataset name, as listed by ``fullgraph datasets``.
        graph: square CSR by destination, as stored (self-loops as in the source).
        data: features, labels, masks.
        info: provenance and description (source files, licence, split scheme).
        shard: None for a whole dataset; for one part of a sharded dataset
            (``fullgraph partition --shards``), what the part holds: then ``graph``
            keeps only the in-edges of ``shard.edge_rows`` and ``data.features`` only
            the rows ``data.row_ids``.
        checksums: where the dataset was opened from the store, the checksum of each
            array file as recorded when it was written (``store``), naming the data
            without reading it; None for a dataset made in memory.
    """

    name: str
    graph: Graph
    data: VertexData
    info: dict[str, Any] = field(default_factory=dict)
    shard: Shard | None = None
    checksums: dict[str, str] | None = None

    def validate(self) -> None:
        """Check that graph and data are consistent; raise ``ValidationError`` if not."""
        if self.graph.num_src != self.graph.num_dst:
            raise ValidationError("a dataset graph must be square", source=self.name,
                                  field="graph", found=repr(self.graph))
        if self.graph.num_nodes == 0:
            raise ValidationError("the graph is empty", source=self.name, field="graph",
                                  found="0 vertices", expected="at least one vertex")
        self.data.validate(self.graph.num_nodes, self.name)

    def summary(self) -> dict[str, Any]:
        """Counts a user wants to see in ``fullgraph datasets``."""
        d = self.data
        edges = self.graph.num_edges if self.shard is None else self.shard.num_edges
        return {"name": self.name, "vertices": self.graph.num_nodes, "edges": edges,
                "features": d.num_features,
                "classes": d.num_classes, "train": int(d.train_mask.sum()),
                "val": int(d.val_mask.sum()), "test": int(d.test_mask.sum())}


def _check_finite(x: Tensor, source: str, block_rows: int = 1 << 16) -> None:
    """Raise on the first NaN/inf feature, scanning in row blocks (memory-mapped safe)."""
    if is_sparse(x):  # the stored entries only
        bad_entries = (~torch.isfinite(x.values())).nonzero()
        if bad_entries.numel():
            e = int(bad_entries[0, 0])
            r = int(torch.searchsorted(x.crow_indices(), torch.tensor(e), right=True)) - 1
            raise ValidationError("feature is not finite", source=source,
                                  field=f"features[{r}, {int(x.col_indices()[e])}]",
                                  found=float(x.values()[e]), expected="a finite number")
        return
    for start, blk in row_blocks(x, block_rows):
        bad = ~torch.isfinite(blk)
        if bool(bad.any()):
            r, c = (int(v) for v in torch.nonzero(bad)[0])
            raise ValidationError("feature is not finite", source=source,
                                  field=f"features[{start + r}, {c}]",
                                  found=float(blk[r, c]), expected="a finite number")
