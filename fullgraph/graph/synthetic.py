"""Seeded synthetic datasets: R-MAT power-law graphs and stochastic block models.

R-MAT (Chakrabarti, Zhan and Faloutsos, SDM 2004) drops each edge into one quadrant
of the adjacency matrix with probabilities (a, b, c, d), recursively, one bit of the
source and destination id per level; NeutronTask (section 6.9) scales vertices,
edges, feature width, label count and training ratio with it. The stochastic block
model gives a graph whose features and edges both carry the class, so accuracy on
it means something.

Every generator is a pure function of its arguments: the same seed gives the same
dataset on any machine, with or without numba. R-MAT draws its random bits from a
counter-based hash (SplitMix64 of seed and edge number), so the numba kernel
(parallel over edges) and the numpy fallback (vectorised over edges, one level at
a time) produce identical edges.

This module must not import torch.distributed or anything above the graph layer.

Shapes: N = number of vertices, E = number of edges, F = feature dimension,
C = number of classes.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from fullgraph.errors import ValidationError
from fullgraph.graph.csr import INT32_LIMIT, Graph, SelfLoops
from fullgraph.graph.data import FEATURE_DTYPES, Dataset, VertexData
from fullgraph.graph.split import fraction_split
from fullgraph.graph.store import ArrayAppender, DatasetWriter

try:
    import numba
except ImportError:  # numba is optional (the "fast" extra); numpy gives the same edges
    numba = None  # type: ignore[assignment]

LabelScheme = Literal["random", "degree"]
BLOCK_EDGES = 1 << 22  # edges generated per kernel call; bounds numpy temporaries
FEATURE_BLOCK_ROWS = 1 << 16  # feature rows drawn at once by write_rmat
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_LOW32 = np.uint64(0xFFFFFFFF)
_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)


# ----------------------------------------------------------------------- R-MAT
def rmat_edges(num_nodes: int, num_edges: int, *, a: float = 0.57, b: float = 0.19,
               c: float = 0.19, d: float = 0.05, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Draw ``num_edges`` directed R-MAT edges ``src -> dst`` over ``num_nodes`` vertices.

    Quadrant a is (src bit 0, dst bit 0), b is (0, 1), c is (1, 0), d is (1, 1); the
    top level picks the most significant bit. When ``num_nodes`` is not a power of
    two, edges are drawn over the next power of two and those with an endpoint out of
    range are rejected and topped up, so the edges follow the R-MAT distribution
    conditioned on both ids being in range (no folding, which would create hot
    spots). Duplicates and self-loops are kept; with ``a`` the largest, vertex 0 is the densest.

    Args:
        num_nodes: number of vertices N (>= 1).
        num_edges: number of edges E to draw (>= 0).
        a, b, c, d: quadrant probabilities, non-negative and summing to 1
            (default: 0.57, 0.19, 0.19, 0.05, the Graph500 values).
        seed: random seed (default: 0).

    Returns:
        ``(src, dst)``, each (E,) int64 in ``[0, N)``.

    Raises:
        ValidationError: bad counts or probabilities, or probabilities that put
            (almost) no edge in range.
    """
    blocks = _rmat_blocks(num_nodes, num_edges, a, b, c, d, seed)
    src, dst = np.empty(num_edges, np.int64), np.empty(num_edges, np.int64)
    filled = 0
    for s, t in blocks:
        src[filled:filled + s.size], dst[filled:filled + s.size] = s, t
        filled += s.size
    return src, dst


def _rmat_blocks(num_nodes: int, num_edges: int, a: float, b: float, c: float, d: float,
                 seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The edges of ``rmat_edges`` in blocks of at most ``BLOCK_EDGES``, in order.

    The arguments are checked here, before the first block is asked for.
    """
    _check_probabilities(a, b, c, d)
    _check_count(num_nodes, "num_nodes", minimum=1)
    _check_count(num_edges, "num_edges", minimum=0)
    _check_count(seed, "seed", minimum=0)
    scale = (num_nodes - 1).bit_length()
    all_in_range = num_nodes == 1 << scale
    accept = 1.0 if all_in_range else _in_range_probability(num_nodes - 1, scale, (a, b, c, d))
    if accept < 1e-6:
        raise ValidationError("R-MAT probabilities put almost no edge inside num_nodes",
                              field="a, b, c, d", found=(a, b, c, d),
                              hint=f"acceptance {accept:.2e}; raise a or use a power of two")
    base = np.uint64(np.random.SeedSequence(seed).generate_state(1, np.uint64)[0])
    cuts = tuple(np.uint64(min(round(p * 2**32), 2**32)) for p in (a, a + b, a + b + c))

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        filled, counter = 0, 0
        while filled < num_edges:
            need = num_edges - filled
            count = need if all_in_range else int(need / accept * 1.02) + 1024
            count = min(count, BLOCK_EDGES)
            s, t = _rmat_block(counter, count, scale, base, cuts)
            if not all_in_range:
                keep = (s < num_nodes) & (t < num_nodes)
                s, t = s[keep], t[keep]
            take = min(need, s.size)  # the first accepted edges in counter order
            if take:
                yield s[:take], t[:take]
            filled, counter = filled + take, counter + count

    return blocks()


def rmat(num_nodes: int, num_edges: int, *, a: float = 0.57, b: float = 0.19, c: float = 0.19,
         d: float = 0.05, seed: int = 0, num_features: int = 128, num_classes: int = 47,
         symmetrize: bool = False, self_loops: SelfLoops = "remove", train: float = 0.6,
         val: float = 0.2, feature_dtype: str = "float32",
         labels: LabelScheme = "random") -> Dataset:
    """An R-MAT graph with random features, for scaling benchmarks (NeutronTask 6.9).

    Edges come from ``rmat_edges`` and are de-duplicated, so the graph has at most
    ``num_edges`` edges (``2 * num_edges`` when symmetrised). Features are standard
    normal; they carry no class signal.

    Args:
        num_nodes, num_edges, a, b, c, d, seed: as in ``rmat_edges``.
        num_features: feature dimension F (default: 128).
        num_classes: number of classes C (default: 47, as ogbn-products).
        symmetrize: add the reverse of every edge (default: False).
        self_loops: ``"remove"``, ``"keep"`` or ``"add"`` (default: ``"remove"``).
        train, val: fractions of vertices in the train and validation masks; the
            rest is test (default: 0.6, 0.2).
        feature_dtype: float32, bfloat16 or float16 storage (default: float32).
        labels: ``"random"`` (uniform classes) or ``"degree"`` (C equal-size
            in-degree bands, learnable from structure) (default: ``"random"``).

    Raises:
        ValidationError: on any out-of-range argument.
    """
    _check_count(num_features, "num_features", minimum=1)
    _check_count(num_classes, "num_classes", minimum=1)
    _check_choice(feature_dtype, "feature_dtype", tuple(FEATURE_DTYPES))
    _check_choice(labels, "labels", ("random", "degree"))
    src, dst = rmat_edges(num_nodes, num_edges, a=a, b=b, c=c, d=d, seed=seed)
    graph = Graph.from_edges(src, dst, num_nodes, symmetrize=symmetrize,
                             self_loops=self_loops)
    del src, dst
    feature_seed, label_seed, split_seed = _child_seeds(seed, 3)
    features = _randn((num_nodes, num_features), feature_seed).to(FEATURE_DTYPES[feature_dtype])
    y = _rmat_labels(graph.in_degrees(), num_classes, labels, label_seed, num_nodes)
    masks = fraction_split(y, train=train, val=val, seed=split_seed)
    info = _rmat_info(num_nodes, num_edges, a, b, c, d, seed, symmetrize, self_loops, labels,
                      train, val)
    return Dataset(f"rmat-{num_nodes}-{num_edges}", graph,
                   VertexData(features, y, *masks, num_classes), info)


def write_rmat(path: Path | str, num_nodes: int, num_edges: int, *, a: float = 0.57,
               b: float = 0.19, c: float = 0.19, d: float = 0.05, seed: int = 0,
               num_features: int = 128, num_classes: int = 47, symmetrize: bool = False,
               self_loops: SelfLoops = "remove", train: float = 0.6, val: float = 0.2,
               feature_dtype: str = "float32", labels: LabelScheme = "random",
               name: str | None = None, memory_bytes: int = 1 << 30) -> dict[str, Any]:
    """Write ``rmat(...)`` straight into the dataset directory ``path``, in bounded memory.

    The directory is byte for byte the one ``store.save_dataset(rmat(...), path)``
    writes (same arrays, same checksums), but no (E,) or (N, F) array is ever held
    whole. Edges go in destination ranges whose sort keys fit in ``memory_bytes``
    (8 bytes per drawn edge): when one range holds every edge they are drawn once,
    otherwise once to count each destination's edges and once more per range. Each
    range is sorted, de-duplicated and appended to ``indices.npy``; features are drawn
    and written 65,536 rows at a time. Beside the keys, it
    holds about 40 bytes per vertex (degrees, labels, masks, the split's permutation).

    Args:
        path: the dataset directory to write (replaced atomically, as ``save_dataset``).
        num_nodes ... labels: as in ``rmat``.
        name: the dataset's name (default: ``rmat-{num_nodes}-{num_edges}``).
        memory_bytes: bound on the edge sort keys held at once (default: 1 GiB).

    Returns:
        ``{"name", "vertices", "edges", "ranges"}``: ``ranges`` is the number of
        destination ranges (passes over the edges after the counting one).

    Raises:
        ValidationError: on any out-of-range argument.
    """
    _check_count(num_features, "num_features", minimum=1)
    _check_count(num_classes, "num_classes", minimum=1)
    _check_count(memory_bytes, "memory_bytes", minimum=1)
    _check_choice(feature_dtype, "feature_dtype", tuple(FEATURE_DTYPES))
    _check_choice(labels, "labels", ("random", "degree"))
    _check_choice(self_loops, "self_loops", ("remove", "keep", "add"))

    def edges() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for s, t in _rmat_blocks(num_nodes, num_edges, a, b, c, d, seed):
            if symmetrize:
                s, t = np.concatenate([s, t]), np.concatenate([t, s])
            if self_loops != "keep":
                keep = s != t
                s, t = s[keep], t[keep]
            yield s, t

    _rmat_blocks(num_nodes, num_edges, a, b, c, d, seed)  # checks the rest up front
    loops = self_loops == "add"
    bound = num_edges * (2 if symmetrize else 1) + (num_nodes if loops else 0)
    feature_seed, label_seed, split_seed = _child_seeds(seed, 3)
    name = name or f"rmat-{num_nodes}-{num_edges}"
    with DatasetWriter(path) as writer:
        filled, in_degree, ranges = _write_edges(writer, edges, num_nodes, bound, loops,
                                                 memory_bytes)
        x = writer.append("features", FEATURE_DTYPES[feature_dtype], (num_features,))
        for block in _randn_rows(num_nodes, num_features, feature_seed):
            x.append(block.to(FEATURE_DTYPES[feature_dtype]))
        writer.close("features")
        if labels == "degree":
            y = _labels_by_degree(torch.from_numpy(in_degree), num_classes, label_seed)
        else:
            y = _rmat_labels(None, num_classes, labels, label_seed, num_nodes)
        del in_degree
        writer.put("labels", y)
        for mask_name, mask in zip(("train_mask", "val_mask", "test_mask"),
                                   fraction_split(y, train=train, val=val, seed=split_seed)):
            writer.put(mask_name, mask)
        writer.commit(name=name, num_nodes=num_nodes, num_edges=filled,
                      num_classes=num_classes,
                      info=_rmat_info(num_nodes, num_edges, a, b, c, d, seed, symmetrize,
                                      self_loops, labels, train, val))
    return {"name": name, "vertices": num_nodes, "edges": filled, "ranges": ranges}


def _write_edges(writer: DatasetWriter, edges: Any, num_nodes: int, bound: int, loops: bool,
                 memory_bytes: int) -> tuple[int, np.ndarray, int]:
    """Write ``indices`` and ``indptr`` of the de-duplicated CSR by destination of the
    edges ``edges()`` yields (blocks of (src, dst); every call yields the same), plus
    one self-loop per vertex where ``loops``, holding at most ``memory_bytes`` of sort
    keys (8 bytes per edge) at once.

    ``bound`` is at least the number of edges drawn (self-loops included). When it fits
    in the keys, the edges are drawn once; otherwise once to count each destination's
    edges and once more per destination range. Returns (edges written, the in-degrees,
    the number of ranges)."""
    capacity = max(1, memory_bytes // 8)
    if bound <= capacity:
        ranges, drawn = [(0, num_nodes)], np.array([bound])
    else:  # count each destination's edges, then cut ranges whose keys fit
        counts = np.zeros(num_nodes, np.int64)
        for _, t in edges():
            counts += np.bincount(t, minlength=num_nodes)
        counts += 1 if loops else 0
        ranges, drawn = _ranges_by_count(counts, capacity)
        del counts
    index_dtype = torch.int32 if num_nodes <= INT32_LIMIT else torch.int64
    indices = writer.append("indices", index_dtype)
    indptr = np.zeros(num_nodes + 1, np.int64)
    filled = 0
    for (lo, hi), size in zip(ranges, drawn):
        keys = np.empty(int(size), np.int64)
        k = 0
        for s, t in edges():
            if (lo, hi) != (0, num_nodes):
                inside = (t >= lo) & (t < hi)
                s, t = s[inside], t[inside]
            keys[k:k + s.size] = (t - lo) * np.int64(num_nodes) + s
            k += s.size
        if loops:
            v = np.arange(lo, hi, dtype=np.int64)
            keys[k:k + v.size] = (v - lo) * np.int64(num_nodes) + v
            k += v.size
        keys = keys[:k]
        keys.sort()
        filled = _append_rows(keys, lo, num_nodes, indices, filled, indptr)
        del keys
    np.cumsum(indptr, out=indptr)
    writer.close("indices")
    writer.put("indptr", torch.from_numpy(indptr))
    return filled, np.diff(indptr), len(ranges)


def _randn_rows(num_rows: int, num_cols: int, seed: int) -> Iterator[torch.Tensor]:
    """Standard normal (num_rows, num_cols) float32 rows from ``seed``, in blocks of
    ``FEATURE_BLOCK_ROWS`` rows; together the same values as one draw of the whole
    (torch fills normals 16 at a time, and 16 divides ``FEATURE_BLOCK_ROWS * F``)."""
    gen = torch.Generator().manual_seed(seed)
    for lo in range(0, num_rows, FEATURE_BLOCK_ROWS):
        rows = min(FEATURE_BLOCK_ROWS, num_rows - lo)
        yield torch.randn((rows, num_cols), generator=gen, dtype=torch.float32)


def _ranges_by_count(counts: np.ndarray, capacity: int) -> tuple[list[tuple[int, int]],
                                                                  np.ndarray]:
    """Cut ``[0, N)`` into destination ranges of at most ``capacity`` edges each.

    A single destination with more edges than ``capacity`` gets a range of its own.
    """
    cum = np.cumsum(counts)
    ranges, sizes, lo = [], [], 0
    while lo < counts.size:
        before = int(cum[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(cum, before + capacity, side="right")))
        ranges.append((lo, hi))
        sizes.append(int(cum[hi - 1]) - before)
        lo = hi
    return ranges, np.array(sizes, np.int64)


def _append_rows(keys: np.ndarray, lo: int, num_nodes: int, out: ArrayAppender,
                 filled: int, indptr: np.ndarray) -> int:
    """Write the distinct sorted ``(dst - lo) * N + src`` keys as CSR rows from ``lo``.

    Sources are appended to ``out``; each row's edge count is added into
    ``indptr[dst + 1]`` (a cumulative sum later makes it the row pointer). Works in
    slices of ``BLOCK_EDGES`` keys, so temporaries stay small. Returns the new fill.
    """
    width = np.int64(num_nodes)
    for start in range(0, keys.size, BLOCK_EDGES):
        k = keys[start:start + BLOCK_EDGES]
        keep = np.empty(k.size, dtype=bool)
        keep[0] = start == 0 or k[0] != keys[start - 1]
        np.not_equal(k[1:], k[:-1], out=keep[1:])
        k = k[keep]
        dst = k // width
        out.append((k - dst * width).astype(out.stored))
        filled += k.size
        first = np.flatnonzero(np.concatenate([[True], dst[1:] != dst[:-1]]))
        indptr[lo + 1 + dst[first]] += np.diff(np.append(first, k.size))
    return filled


# ------------------------------------------------------------ block model
SBM_BLOCK_VERTICES = 1 << 16
"""Vertices whose out-edges one draw of the block model makes, each block from a seed
of its own: the edges are the same however they are written (``sbm``, ``write_sbm``)."""


def sbm(num_nodes: int, num_classes: int, *, avg_degree: float = 10.0, homophily: float = 0.8,
        num_features: int = 64, feature_noise: float = 1.0, seed: int = 0,
        self_loops: SelfLoops = "remove", train: float = 0.6, val: float = 0.2,
        feature_dtype: str = "float32") -> Dataset:
    """A symmetric stochastic block model whose features and edges both carry the class.

    Classes are balanced (sizes differ by at most one). Each vertex draws a
    Poisson(``avg_degree / 2``) number of out-edges, so after symmetrisation the mean
    degree is about ``avg_degree``; each edge stays in the vertex's block with
    probability ``homophily``, else goes to a uniform vertex of a uniform other block.
    Features are ``mu[label] + feature_noise * noise`` with class means ``mu`` drawn
    N(0, I / F) (unit norm on average) and standard normal noise, so two classes are
    about ``sqrt(2) / feature_noise`` noise deviations apart: features alone classify
    above chance, and averaging over homophilous neighbours does better.
    ``write_sbm`` writes the same dataset to disk in bounded memory.

    Args:
        num_nodes: number of vertices N (>= num_classes).
        num_classes: number of classes C (>= 1; with one class every edge is inside).
        avg_degree: expected mean degree of the symmetric graph (default: 10.0).
        homophily: expected fraction of edges joining same-class vertices (default: 0.8).
        num_features: feature dimension F (default: 64).
        feature_noise: standard deviation of the per-dimension noise (default: 1.0).
        seed: random seed (default: 0).
        self_loops: ``"remove"``, ``"keep"`` or ``"add"`` (default: ``"remove"``).
        train, val: mask fractions, the rest is test (default: 0.6, 0.2).
        feature_dtype: float32, bfloat16 or float16 storage (default: float32).

    Raises:
        ValidationError: on any out-of-range argument.
    """
    model = _SBM(num_nodes, num_classes, avg_degree, homophily, num_features, feature_noise,
                 seed, self_loops, train, val, feature_dtype)
    blocks = list(model.edges(directed=True))
    src = np.concatenate([b[0] for b in blocks]) if blocks else np.zeros(0, np.int64)
    dst = np.concatenate([b[1] for b in blocks]) if blocks else np.zeros(0, np.int64)
    del blocks
    graph = Graph.from_edges(src, dst, num_nodes, symmetrize=True, self_loops=self_loops)
    del src, dst
    dtype = FEATURE_DTYPES[feature_dtype]
    features = torch.cat([block.to(dtype) for block in model.features()])
    y = torch.from_numpy(model.y)
    return Dataset(model.name, graph,
                   VertexData(features, y, *model.masks(y), num_classes), model.info())


def write_sbm(path: Path | str, num_nodes: int, num_classes: int, *, avg_degree: float = 10.0,
              homophily: float = 0.8, num_features: int = 64, feature_noise: float = 1.0,
              seed: int = 0, self_loops: SelfLoops = "remove", train: float = 0.6,
              val: float = 0.2, feature_dtype: str = "float32", name: str | None = None,
              memory_bytes: int = 1 << 30) -> dict[str, Any]:
    """Write ``sbm(...)`` straight into the dataset directory ``path``, in bounded memory.

    The directory is byte for byte the one ``store.save_dataset(sbm(...), path)``
    writes, as ``write_rmat`` does for R-MAT: edges go in destination ranges whose sort
    keys fit in ``memory_bytes``, features are drawn and written 65,536 rows at a time.
    Beside the keys it holds about 40 bytes per vertex (labels, the class members, the
    degrees, the split) and one block of ``SBM_BLOCK_VERTICES`` vertices' edges.

    Args:
        path: the dataset directory to write (replaced atomically, as ``save_dataset``).
        num_nodes ... feature_dtype: as in ``sbm``.
        name: the dataset's name (default: ``sbm-{num_nodes}-{num_classes}``).
        memory_bytes: bound on the edge sort keys held at once (default: 1 GiB).

    Returns:
        ``{"name", "vertices", "edges", "ranges"}`` as ``write_rmat``.

    Raises:
        ValidationError: on any out-of-range argument.
    """
    _check_count(memory_bytes, "memory_bytes", minimum=1)
    model = _SBM(num_nodes, num_classes, avg_degree, homophily, num_features, feature_noise,
                 seed, self_loops, train, val, feature_dtype)
    loops = self_loops == "add"
    bound = 2 * model.num_directed_edges() + (num_nodes if loops else 0)
    name = name or model.name
    dtype = FEATURE_DTYPES[feature_dtype]
    with DatasetWriter(path) as writer:
        filled, in_degree, ranges = _write_edges(writer, model.edges, num_nodes, bound, loops,
                                                 memory_bytes)
        del in_degree
        x = writer.append("features", dtype, (num_features,))
        for block in model.features():
            x.append(block.to(dtype))
        writer.close("features")
        y = torch.from_numpy(model.y)
        writer.put("labels", y)
        for mask_name, mask in zip(("train_mask", "val_mask", "test_mask"), model.masks(y)):
            writer.put(mask_name, mask)
        writer.commit(name=name, num_nodes=num_nodes, num_edges=filled,
                      num_classes=num_classes, info=model.info())
    return {"name": name, "vertices": num_nodes, "edges": filled, "ranges": ranges}


class _SBM:
    """One block model's draws, checked on construction: the labels (held whole), the
    edges and the feature rows in blocks, the split."""

    def __init__(self, num_nodes: int, num_classes: int, avg_degree: float, homophily: float,
                 num_features: int, feature_noise: float, seed: int, self_loops: str,
                 train: float, val: float, feature_dtype: str) -> None:
        _check_sbm_args(num_nodes, num_classes, avg_degree, homophily, num_features,
                        feature_noise)
        _check_count(seed, "seed", minimum=0)
        _check_choice(feature_dtype, "feature_dtype", tuple(FEATURE_DTYPES))
        _check_choice(self_loops, "self_loops", ("remove", "keep", "add"))
        self.num_nodes, self.num_classes, self.num_features = num_nodes, num_classes, num_features
        self.avg_degree, self.homophily, self.feature_noise = avg_degree, homophily, feature_noise
        self.seed, self.self_loops, self.train, self.val = seed, self_loops, train, val
        self.name = f"sbm-{num_nodes}-{num_classes}"
        (self.edge_seed, self.noise_seed, self.split_seed, label_seed,
         self.mean_seed) = _child_seeds(seed, 5)
        self.y = np.random.default_rng(label_seed).permutation(
            np.arange(num_nodes, dtype=np.int64) % num_classes)

    def _block_rng(self, block: int) -> np.random.Generator:
        return np.random.default_rng([self.edge_seed, block])

    def _blocks(self) -> Iterator[tuple[int, int, int]]:
        for block, lo in enumerate(range(0, self.num_nodes, SBM_BLOCK_VERTICES)):
            yield block, lo, min(lo + SBM_BLOCK_VERTICES, self.num_nodes)

    def num_directed_edges(self) -> int:
        """Out-edges drawn before symmetrisation (each block's first draw only)."""
        return sum(int(self._block_rng(b).poisson(self.avg_degree / 2, hi - lo).sum())
                   for b, lo, hi in self._blocks())

    def edges(self, directed: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(src, dst) per block of source vertices: Poisson out-degrees, each edge in
        the source's class with probability ``homophily``. Unless ``directed``, every
        edge in both directions, and self-loops dropped unless ``self_loops`` keeps
        them (the writer adds its own)."""
        y, classes = self.y, self.num_classes
        members = np.argsort(y, kind="stable")  # vertices grouped by class
        sizes = np.bincount(y, minlength=classes)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        for b, lo, hi in self._blocks():
            rng = self._block_rng(b)
            src = np.repeat(np.arange(lo, hi, dtype=np.int64),
                            rng.poisson(self.avg_degree / 2, hi - lo))
            block = y[src]
            if classes > 1:
                outside = rng.random(src.size) >= self.homophily
                shift = rng.integers(1, classes, src.size)
                block = np.where(outside, (block + shift) % classes, block)
            dst = members[starts[block] + rng.integers(0, sizes[block])]
            if not directed:
                src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
                if self.self_loops != "keep":
                    keep = src != dst
                    src, dst = src[keep], dst[keep]
            yield src, dst

    def features(self) -> Iterator[torch.Tensor]:
        """float32 feature rows in blocks of ``FEATURE_BLOCK_ROWS``."""
        mu = _randn((self.num_classes, self.num_features), self.mean_seed)
        mu = mu / self.num_features**0.5
        lo = 0
        for noise in _randn_rows(self.num_nodes, self.num_features, self.noise_seed):
            rows = torch.from_numpy(self.y[lo:lo + noise.shape[0]])
            yield mu[rows] + self.feature_noise * noise
            lo += noise.shape[0]

    def masks(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return fraction_split(y, train=self.train, val=self.val, seed=self.split_seed)

    def info(self) -> dict[str, Any]:
        return {"generator": "sbm", "num_nodes": self.num_nodes,
                "num_classes": self.num_classes, "avg_degree": self.avg_degree,
                "homophily": self.homophily, "feature_noise": self.feature_noise,
                "seed": self.seed, "self_loops": self.self_loops, "train_fraction": self.train,
                "val_fraction": self.val}


def _rmat_block(start: int, count: int, scale: int, base: np.uint64,
                cuts: tuple[np.uint64, ...], use_numba: bool | None = None,
                ) -> tuple[np.ndarray, np.ndarray]:
    """Edges number ``start .. start + count - 1`` over ``2**scale`` vertices."""
    src, dst = np.empty(count, np.int64), np.empty(count, np.int64)
    if use_numba if use_numba is not None else _rmat_kernel is not None:
        assert _rmat_kernel is not None
        _rmat_kernel(start, count, scale, base, cuts[0], cuts[1], cuts[2], src, dst)
        return src, dst
    src.fill(0)
    dst.fill(0)
    edge = np.arange(start, start + count, dtype=np.uint64)
    words = np.uint64((scale + 1) // 2)  # one 64-bit hash feeds two levels
    for w in range(int(words)):
        z = _mix(base + (edge * words + np.uint64(w)) * _GAMMA)
        for level, r in ((2 * w, z >> _S32), (2 * w + 1, z & _LOW32)):
            if level >= scale:
                break
            src_bit = r >= cuts[1]
            dst_bit = ((r >= cuts[0]) & ~src_bit) | (r >= cuts[2])
            src <<= 1
            src |= src_bit
            dst <<= 1
            dst |= dst_bit
    return src, dst


def _mix(z: Any) -> Any:
    """SplitMix64 finaliser; works on numpy uint64 arrays and (under numba) scalars."""
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


def _rmat_kernel_py(start: int, count: int, scale: int, base: np.uint64, cut_a: np.uint64,
                    cut_ab: np.uint64, cut_abc: np.uint64, src: np.ndarray,
                    dst: np.ndarray) -> None:
    """Numba body of ``_rmat_block``: same bits, one edge per iteration, in parallel."""
    words = (scale + 1) // 2
    uwords = np.uint64(words)
    for i in numba.prange(count):
        edge = np.uint64(start + i)
        s, t = 0, 0
        for w in range(words):
            z = _mix_jit(base + (edge * uwords + np.uint64(w)) * _GAMMA)
            for half in range(2):
                if 2 * w + half < scale:
                    r = (z >> _S32) if half == 0 else (z & _LOW32)
                    src_bit = 1 if r >= cut_ab else 0
                    dst_bit = 1 if (cut_a <= r < cut_ab) or r >= cut_abc else 0
                    s, t = 2 * s + src_bit, 2 * t + dst_bit
        src[i], dst[i] = s, t


if numba is not None:
    _mix_jit = numba.njit(inline="always")(_mix)
    _rmat_kernel = numba.njit(parallel=True, cache=True)(_rmat_kernel_py)
else:
    _rmat_kernel = None


def _in_range_probability(limit: int, scale: int, probs: tuple[float, ...]) -> float:
    """P(src <= limit and dst <= limit) for one R-MAT edge over ``2**scale`` ids.

    A digit DP over the bits of ``limit``, top down; the state says whether src and
    dst still equal ``limit``'s prefix ("tight"): a tight id may not take a 1 where
    ``limit`` has a 0.
    """
    quadrants = [((0, 0), probs[0]), ((0, 1), probs[1]), ((1, 0), probs[2]), ((1, 1), probs[3])]
    state = {(True, True): 1.0}
    for level in reversed(range(scale)):
        bit = (limit >> level) & 1
        nxt: dict[tuple[bool, bool], float] = {}
        for (tight_s, tight_t), p in state.items():
            for (sb, tb), q in quadrants:
                if (tight_s and sb > bit) or (tight_t and tb > bit):
                    continue
                key = (tight_s and sb == bit, tight_t and tb == bit)
                nxt[key] = nxt.get(key, 0.0) + p * q
        state = nxt
    return min(1.0, sum(state.values()))


# --------------------------------------------------------------------- helpers
def _rmat_info(num_nodes: int, num_edges: int, a: float, b: float, c: float, d: float,
               seed: int, symmetrize: bool, self_loops: str, labels: str, train: float,
               val: float) -> dict[str, Any]:
    return {"generator": "rmat", "num_nodes": num_nodes, "requested_edges": num_edges,
            "a": a, "b": b, "c": c, "d": d, "seed": seed, "symmetrize": symmetrize,
            "self_loops": self_loops, "labels": labels, "train_fraction": train,
            "val_fraction": val}


def _rmat_labels(in_degree: torch.Tensor | None, num_classes: int, scheme: LabelScheme,
                 seed: int, num_nodes: int) -> torch.Tensor:
    if scheme == "degree":
        assert in_degree is not None
        return _labels_by_degree(in_degree, num_classes, seed)
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, num_classes, num_nodes, dtype=np.int64))


def _labels_by_degree(in_degree: torch.Tensor, num_classes: int, seed: int) -> torch.Tensor:
    """C equal-size classes by in-degree rank (ties broken at random)."""
    deg = in_degree.numpy()
    tie = np.random.default_rng(seed).random(deg.size)
    order = np.lexsort((tie, deg))
    y = np.empty(deg.size, dtype=np.int64)
    y[order] = np.arange(deg.size, dtype=np.int64) * num_classes // max(deg.size, 1)
    return torch.from_numpy(y)


def _randn(shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def _child_seeds(seed: int, count: int) -> list[int]:
    """Independent seeds for the parts of one generator (edges, features, split)."""
    children = np.random.SeedSequence(seed).spawn(count)
    return [int(child.generate_state(1)[0]) for child in children]


def _check_probabilities(a: float, b: float, c: float, d: float) -> None:
    probs = (a, b, c, d)
    bad = [f"{name} = {p}" for name, p in zip("abcd", probs) if not 0.0 <= p <= 1.0]
    if bad:
        raise ValidationError("R-MAT probabilities must be in [0, 1]", field="a, b, c, d",
                              found=", ".join(bad), expected="0 <= each <= 1, a sum of 1")
    if abs(sum(probs) - 1.0) > 1e-6:
        raise ValidationError("R-MAT probabilities must be in [0, 1] and sum to 1",
                              field="a, b, c, d", found=f"{probs} (sum {sum(probs):.6g})",
                              expected="a + b + c + d == 1")


def _check_count(value: int, name: str, *, minimum: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValidationError("out of range" if isinstance(value, (int, np.integer))
                              and not isinstance(value, bool) else "must be an integer",
                              field=name, found=value, expected=f"an integer >= {minimum}")


def _check_choice(value: str, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValidationError("unknown choice", field=name, found=value,
                              expected=" | ".join(choices))


def _check_sbm_args(num_nodes: int, num_classes: int, avg_degree: float, homophily: float,
                    num_features: int, feature_noise: float) -> None:
    _check_count(num_classes, "num_classes", minimum=1)
    _check_count(num_nodes, "num_nodes", minimum=num_classes)
    _check_count(num_features, "num_features", minimum=1)
    if avg_degree > num_nodes - 1:  # (NaN passes here, and is refused below)
        raise ValidationError("out of range", field="avg_degree", found=avg_degree,
                              expected=f"at most {num_nodes - 1} (vertices - 1) on "
                              f"{num_nodes} vertices")
    for name, value, ok in (("avg_degree", avg_degree, avg_degree >= 0),
                            ("homophily", homophily, 0.0 <= homophily <= 1.0),
                            ("feature_noise", feature_noise, feature_noise >= 0)):
        if not ok:
            raise ValidationError("out of range", field=name, found=value,
                                  expected="0 <= homophily <= 1" if name == "homophily"
                                  else ">= 0")
