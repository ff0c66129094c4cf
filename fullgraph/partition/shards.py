"""Per-part shards: each worker's own rows, in-edges and replicated halo, apart.

``fullgraph partition --shards DIR`` writes one dataset directory per part of a
partition, so that hosts without shared storage each hold a part, not the whole
dataset (as DistDGL's partitions). Part p of a partition with ``hops`` = h keeps:

- the feature rows of C_h, where C_0 is the part's own vertices and C_k adds the
  in-neighbours of C_(k-1): the rows a data-parallel worker reads, its own for
  DepComm and up to h hops of replicated inputs for DepCache (NeutronCloud §2.3);
- the in-edges of C_(h-1) (of C_0 when h = 0), with global vertex ids: the rows
  the worker aggregates, its own and those it recomputes;
- per vertex of the whole graph, small arrays every worker needs: the partition,
  the labels and masks, and the in-degree without self-loops (the edge norms of a
  vertex do not depend on which edges a part holds); 8 bytes of CSR row pointer too.

So a part costs about 35 bytes per vertex of the whole graph plus its share of
edges and feature rows. Training on the parts is exact: a data-parallel worker
reads only what its part holds (``parallel.data``), and it refuses a plan that
needs rows or in-edges beyond them (DepCache with more layers than ``hops``); a P2P
worker reads its own rows and in-edges only (any ``hops``) and learns from its peers
which of its rows they read (``parallel.p2p``); a tensor- or task-parallel worker
gathers the whole topology and its block of feature rows from the parts
(``parallel.assemble``).

Layout::

    DIR/shards.json   format, name, parts, hops, vertex and edge counts, partitioner
    DIR/part-<p>/     one dataset directory per part (``graph.store``, with a
                      ``shard`` entry in its meta.json)

Writing is atomic: everything goes into a temporary sibling first, which is then
renamed into place.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fullgraph.errors import ConfigError
from fullgraph.graph import store
from fullgraph.graph.blocks import in_edges
from fullgraph.graph.csr import Graph
from fullgraph.graph.data import Dataset, Shard, VertexData
from fullgraph.graph.sparse import choose_layout, is_sparse
from fullgraph.partition.book import PartitionBook
from fullgraph.paths import sibling_dir

MANIFEST, FORMAT = store.SHARDS_FILE, store.SHARDS_FORMAT
STRATEGIES = ("data", "p2p", "tensor", "task")
"""Strategies that train on shards: each worker reads only its own part from disk
(tensor and task parallelism gather the whole topology from the parts at setup)."""


def closure(graph: Graph, owned: np.ndarray, hops: int) -> list[np.ndarray]:
    """[C_0, ..., C_hops] as bool masks over the vertices: C_0 = ``owned``, C_k adds
    the in-neighbours of C_(k-1)."""
    mask = np.zeros(graph.num_nodes, dtype=bool)
    mask[owned] = True
    levels, frontier = [mask.copy()], owned.astype(np.int64)
    for _ in range(hops):
        _, src, _ = in_edges(graph, frontier)
        frontier = np.unique(src[~mask[src]])
        mask[frontier] = True
        levels.append(mask.copy())
    return levels


def loop_free_in_degree(graph: Graph) -> torch.Tensor:
    """(N,) int64 in-degree of every vertex without its self-loops."""
    src, dst = graph.edges()
    loops = torch.bincount(dst[src == dst], minlength=graph.num_nodes)
    return graph.in_degrees() - loops


def part_dataset(dataset: Dataset, book: PartitionBook, part: int, hops: int,
                 in_degree: torch.Tensor, feature_min: float,
                 fingerprint: dict[str, Any]) -> Dataset:
    """Part ``part`` of ``dataset`` as a shard (see the module docstring)."""
    graph, data = dataset.graph, dataset.data
    owned = book.part_to_gids(part).numpy()
    levels = closure(graph, owned, hops)
    rows = np.flatnonzero(levels[-1])
    edge_rows = np.flatnonzero(levels[max(hops - 1, 0)])
    sub_indptr, _, eids = in_edges(graph, edge_rows)
    counts = np.zeros(graph.num_nodes, dtype=np.int64)
    counts[edge_rows] = np.diff(sub_indptr)
    indptr = np.zeros(graph.num_nodes + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    eid_t = torch.from_numpy(eids)
    weight = None if graph.edge_weight is None else graph.edge_weight[eid_t]
    sub = Graph(torch.from_numpy(indptr), graph.indices[eid_t].clone(), graph.num_nodes,
                weight, validate=False)
    row_t = torch.from_numpy(rows.astype(np.int64))
    x = data.take_features(row_t)  # in the layout --sparse-features auto chose for the whole
    if not is_sparse(x):
        x = x.contiguous()
    vdata = VertexData(x, data.labels, data.train_mask, data.val_mask, data.test_mask,
                       data.num_classes, row_ids=row_t)
    shard = Shard(part, book.num_parts, hops, book.part_of.to(torch.int64), in_degree,
                  torch.from_numpy(edge_rows.astype(np.int64)), graph.num_edges, feature_min,
                  fingerprint)
    return Dataset(dataset.name, sub, vdata, dict(dataset.info), shard=shard)


def check_target(out: str | Path) -> None:
    """Refuse a ``--shards`` directory that cannot take a shard set: something else is
    there, or its parent cannot be written.

    Raises:
        ConfigError: naming the directory.
    """
    from fullgraph.paths import check_output

    out = Path(out)
    replaceable = out.is_dir() and ((out / MANIFEST).is_file() or not any(out.iterdir()))
    if out.exists() and not replaceable:
        raise ConfigError(f"partition --shards: {out} exists and is not a shard set; "
                          "give a new directory")
    if not out.exists():
        check_output(str(out), "--shards", directory=True)


def write_shards(dataset: Dataset, book: PartitionBook, out: Path | str, hops: int,
                 fingerprint: dict[str, Any], method: str = "",
                 split_seed: int | None = 0,
                 source: tuple[str, str] | None = None) -> list[dict[str, int]]:
    """Write one shard per part of ``book`` into ``out``, replacing a shard set there.

    ``fingerprint``: the whole dataset's (``checkpoint.dataset_fingerprint``), which
    every part keeps for checkpoints; ``split_seed``: the seed of the split drawn at
    load time, or None for a dataset whose split was fixed when it was made. Returns
    per part its vertices, held feature rows and held edges. ``source``: the whole
    dataset as ``--dataset`` and ``--root`` name it, kept in each part's ``info``
    (``predict`` and ``evaluate`` of a model trained on the shards open it).

    Raises:
        ConfigError: ``hops`` < 0, the book is of another graph, or ``out`` exists and
            is not a shard set.
    """
    if dataset.shard is not None:
        raise ConfigError(f"partition --shards: {dataset.name!r} is already a shard")
    if hops < 0:
        raise ConfigError(f"partition --shard-hops: must be >= 0, got {hops}")
    if book.num_nodes != dataset.graph.num_nodes:
        raise ConfigError(f"partition --shards: the partition has {book.num_nodes} vertices, "
                          f"the graph {dataset.graph.num_nodes}")
    out = Path(out).expanduser()
    check_target(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the layout `--sparse-features auto` picks for the whole dataset, for every part
    features = choose_layout(dataset.data.features, "auto")
    if features is not dataset.data.features:
        dataset = dataclasses.replace(dataset, data=dataclasses.replace(dataset.data,
                                                                        features=features))
    if source is not None:
        dataset = dataclasses.replace(dataset, info={**dataset.info, SOURCE_KEYS[0]: source[0],
                                                     SOURCE_KEYS[1]: source[1]})
    tmp = sibling_dir(out, "tmp")
    try:
        in_degree = loop_free_in_degree(dataset.graph)
        x = dataset.data.features
        values = x.values() if is_sparse(x) else x
        low = float(values.min()) if values.numel() else 0.0
        feature_min = min(low, 0.0) if is_sparse(x) else low  # sparse: the zeros count
        sizes = []
        for p in range(book.num_parts):
            part = part_dataset(dataset, book, p, hops, in_degree, feature_min, fingerprint)
            store.save_dataset(part, tmp / f"part-{p}")
            sizes.append({"vertices": int(book.part_to_gids(p).numel()),
                          "rows": int(part.data.features.shape[0]),
                          "edges": part.graph.num_edges})
            del part
        manifest = {"format": FORMAT, "name": dataset.name, "parts": book.num_parts,
                    "hops": hops, "num_nodes": dataset.graph.num_nodes,
                    "num_edges": dataset.graph.num_edges, "partitioner": method,
                    "split_seed": split_seed,
                    "sizes": sizes}
        with open(tmp / MANIFEST, "w", encoding="ascii") as f:
            f.write(json.dumps(manifest, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        store.fsync_dir(tmp)
        store.swap_into_place(tmp, out)  # the old set stays whole until the new one is in
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sizes


SOURCE_KEYS = ("whole dataset", "whole dataset root")
"""The ``info`` keys of a part that name the dataset the shards were written from."""


def whole_source(dataset: Dataset) -> tuple[str, str] | None:
    """(``--dataset``, ``--root``) of the dataset a shard was written from, where the
    shards recorded it."""
    name, root = (dataset.info.get(k) for k in SOURCE_KEYS)
    return (str(name), str(root)) if dataset.shard is not None and name and root else None


def require_whole(dataset: Dataset, what: str, also: str = "") -> None:
    """Refuse per-part shards where the whole dataset is needed (ConfigError); ``also``:
    another way on, for the message."""
    if dataset.shard is not None:
        source = whole_source(dataset)
        where = f" under --root {source[1]}" if source else \
            " (with the --root it is under, where that is not the default)"
        raise ConfigError(f"{what}: needs the whole dataset, not one of its per-part shards: "
                          f"give {dataset.name!r}, the dataset they were written from{where}"
                          + (f", {also}" if also else ""))


def check_use(dataset: Dataset, strategy: str, workers: int) -> None:
    """Refuse a run that cannot train on the shard ``dataset`` holds.

    Raises:
        ConfigError: naming the strategy or the worker count that does not fit.
    """
    sh = dataset.shard
    if sh is None:
        return
    if strategy not in STRATEGIES:
        raise ConfigError(f"runtime.strategy: {strategy!r} cannot train on per-part shards "
                          f"(dataset {dataset.name!r}, {sh.parts} shards): one process would "
                          f"need every part; use --workers {sh.parts} with --strategy data, "
                          "p2p, tensor or task, or the unsharded dataset")
    if sh.parts != workers:
        raise ConfigError(f"launch.workers: the dataset is {sh.parts} per-part shards and "
                          f"each worker trains on one; use --workers {sh.parts} (got "
                          f"{workers})")
