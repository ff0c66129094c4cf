"""METIS partitioning (through pymetis), also with the multi-constraint weights of G3.

METIS (Karypis and Kumar, SISC 1998) partitions an undirected graph into parts of
balanced vertex weight with a small edge cut. The CSR here is directed (in-edges),
so METIS sees the symmetrised graph without self-loops and without repeated edges.
Which vertex weights METIS balances, ``constraints``:

- ``"balanced"`` (default): whichever of ``"degree"`` and ``"work"`` leaves the
  busiest part least work, with work ``in_degree + a`` per vertex (below). METIS
  runs with ``"degree"`` first, and with ``"work"`` only where that left a part
  more than ``BALANCED_SLACK`` above the mean work.
- ``"work"``: weight ``in_degree + a``, where ``a`` is the mean in-degree rounded
  (at least 1): a part's P stages cost about its in-edges and its T stages about
  its vertices, counted as an average vertex's in-edges. Isolated vertices weigh 0
  for METIS and are spread afterwards (below).
- ``"vertices+degree"``: two weights, ``(1, in_degree)``: G3 (section 4.2, stage 1,
  the multi-constraint partitioning of Karypis and Kumar, SC 1998) balances both the
  vertex count (T stages) and the in-edge count (P stages) of every part.
- ``"vertices"``: weight 1 (equal vertex counts);
- ``"degree"``: weight ``in_degree`` (equal in-edge counts);
- ``"none"``: no weights passed, which METIS treats as weight 1 per vertex, so it
  gives the same result as ``"vertices"``.

Why not G3's two weights by default: METIS keeps both within its tolerance (vertices
and in-edges within 1.06x max/min on R-MAT and Coauthor CS at 2-5 parts), but the
one combined weight keeps the work even (busiest part 1.000x the mean, against
1.001-1.014x) with about the same cut on R-MAT (within 1.2 %) and 9-18 % fewer cut edges
on Coauthor CS at 2, 4 and 5 parts (2 % more at 3; BENCHMARKS.md, "G3's two
constraints reach METIS").

pymetis's ``part_graph`` passes METIS one constraint, so several constraints are
given to METIS's own ``METIS_PartGraphRecursive``/``Kway`` through ctypes
(``_part_graph_multi``).

A degree constraint on a graph without edges is dropped (it would be all zeros).

Isolated vertices (no neighbour other than themselves) are placed after METIS, by
water-filling the parts with the fewest vertices (``spread_isolated=True``). They
cut no edge, are nobody's remote neighbour and carry at most their self-loops, so
this changes no cut, remote set or (self-loops aside) in-edge count, and only evens
out vertex counts. METIS's refinement moves boundary vertices only, so it leaves
them where coarsening put them: on a 1M-vertex R-MAT graph (34% isolated) with the
default weights, one part got 453k vertices and another 146k.

METIS draws its random choices from ``seed``; the same seed and pymetis build give
the same book. ``num_parts=1`` never calls METIS (nor needs pymetis).

pymetis is a dependency of fullgraph, imported on first use; without it (a broken
install) the call says how to install it.

This module must not import torch.distributed or anything above the partition layer.

Shapes: N = number of vertices, E = number of edges, P = number of parts.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np

from fullgraph.graph.csr import Graph
from fullgraph.partition.book import PartitionBook, check_num_parts

Constraints = Literal["balanced", "work", "vertices+degree", "vertices", "degree", "none"]
CONSTRAINTS = ("balanced", "work", "vertices+degree", "vertices", "degree", "none")
BALANCED_SLACK = 1.03
"""``"balanced"`` runs METIS a second time (``"work"``) only where ``"degree"`` left the
busiest part more than this above the mean work."""
_SEED_MODULUS = 0x7FFFFFFF  # METIS takes a positive C int seed
_METIS_NOPTIONS = 40  # METIS 5's options array length (METIS_NOPTIONS)
_SHIFT = np.uint64(32)
_LOW_BITS = np.uint64(0xFFFFFFFF)


def metis_partition(graph: Graph, num_parts: int, *, seed: int = 0,
                    constraints: Constraints = "balanced", ufactor: int | None = None,
                    recursive: bool | None = None,
                    spread_isolated: bool = True) -> PartitionBook:
    """Partition with METIS on the symmetrised graph, balancing ``constraints``.

    Args:
        graph: a square graph; edge directions and self-loops are ignored.
        num_parts: P, with ``1 <= P <= N``.
        seed: METIS's random seed (default: 0).
        constraints: which vertex weights to balance, see the module docstring
            (default: ``"balanced"``).
        ufactor: allowed load imbalance in thousandths, e.g. 30 for 1.03 (default:
            None, METIS's own: 30 for k-way, 1 per bisection for recursive bisection).
        recursive: recursive bisection instead of k-way (default: None, pymetis's
            choice: recursive for ``P <= 8``).
        spread_isolated: re-place isolated vertices to even out vertex counts
            (default: True).

    Raises:
        ValueError: ``num_parts`` out of range or unknown ``constraints``.
        ImportError: pymetis is not installed (and ``num_parts > 1``).
    """
    num_nodes = graph.num_nodes
    check_num_parts(num_parts, num_nodes)
    if constraints not in CONSTRAINTS:
        raise ValueError(f"constraints must be one of {CONSTRAINTS}, got {constraints!r}")
    if num_parts == 1:
        return PartitionBook.from_assignment(np.zeros(num_nodes, dtype=np.int64), 1)
    xadj, adjncy = symmetric_adjacency(graph)

    def run(weights: Constraints) -> np.ndarray:
        part_of = _run_metis(xadj, adjncy, vertex_weights(graph, weights, xadj), num_parts,
                             seed=seed, ufactor=ufactor, recursive=recursive)
        if spread_isolated:
            _spread_isolated(part_of, xadj, num_parts)
        return part_of

    if constraints != "balanced":
        return PartitionBook.from_assignment(run(constraints), num_parts)
    degree = graph.in_degrees().cpu().numpy()
    part_of = run("degree")  # without edges: vertex counts (with one warning)
    busiest = work_imbalance(part_of, degree, num_parts)
    if busiest > BALANCED_SLACK and degree.any():
        other = run("work")
        if work_imbalance(other, degree, num_parts) < busiest:
            part_of = other
    return PartitionBook.from_assignment(part_of, num_parts)


def work_imbalance(part_of: np.ndarray, degree: np.ndarray, num_parts: int) -> float:
    """The busiest part's work over the mean, work = in-edges + ``a`` per vertex (``a``
    the mean in-degree, as ``"work"`` weighs vertices)."""
    a = _vertex_cost(degree)
    work = np.bincount(part_of, weights=degree, minlength=num_parts) \
        + a * np.bincount(part_of, minlength=num_parts)
    return float(work.max() / work.mean())


def _vertex_cost(degree: np.ndarray) -> int:
    return max(1, int(round(float(degree.mean())))) if degree.size else 1


def _run_metis(xadj: np.ndarray, adjncy: np.ndarray, vweights: np.ndarray | None,
               num_parts: int, *, seed: int, ufactor: int | None,
               recursive: bool | None) -> np.ndarray:
    """(N,) int64 part of each vertex, from ``pymetis.part_graph``."""
    pymetis = _import_pymetis()
    idx_dtype = _idx_dtype(pymetis)
    # METIS (like srand) treats seeds 0 and 1 alike: shift so seeds 0, 1, 2... differ.
    options = pymetis.Options(seed=int(seed) % _SEED_MODULUS + 1)
    if ufactor is not None:
        options.ufactor = int(ufactor)
    if hasattr(pymetis, "CSRAdjacency"):  # pymetis >= 2025.2; older takes xadj/adjncy
        graph_args: dict[str, Any] = {"adjacency": pymetis.CSRAdjacency(
            xadj.astype(idx_dtype, copy=False), adjncy.astype(idx_dtype, copy=False))}
    else:  # pragma: no cover - old pymetis
        graph_args = {"xadj": xadj, "adjncy": adjncy}
    out = _Printed()
    try:
        with _catch_stdout(out):
            if vweights is not None and vweights.ndim == 2 and vweights.shape[1] > 1:
                part = _part_graph_multi(pymetis, xadj, adjncy, vweights, num_parts,
                                         options, recursive)
            else:
                part = pymetis.part_graph(
                    num_parts, **graph_args, options=options, recursive=recursive,
                    vweights=None if vweights is None else vweights.astype(idx_dtype, copy=False)
                ).vertex_part
    except Exception as exc:  # what METIS printed says why ("Input Error: Incorrect ufactor")
        why = "; ".join(line.strip().strip("*").strip()
                        for line in out.text.splitlines() if line.strip())
        raise RuntimeError(f"METIS failed: {why or exc}") from exc
    said: list[str] = []
    other: list[str] = []
    for line in out.text.splitlines():
        msg = line.strip().lstrip("*").strip()
        if line.lstrip().startswith("***"):
            if msg and msg not in said:
                said.append(msg)
        elif line:
            other.append(line)
    if other:  # not METIS's: passed on
        sys.stdout.write("\n".join(other) + "\n")
    if said:  # e.g. "***Cannot bisect a graph with 0 vertices!" on tiny or empty graphs
        warnings.warn(f"METIS: {'; '.join(said)} (the partition it returned is valid and "
                      "is used)", stacklevel=3)
    return np.array(part, dtype=np.int64)


_METIS_OK = 1
_METIS_ERRORS = {-2: "input error", -3: "out of memory", -4: "error"}


def _part_graph_multi(pymetis: Any, xadj: np.ndarray, adjncy: np.ndarray,
                      vweights: np.ndarray, num_parts: int, options: Any,
                      recursive: bool | None) -> np.ndarray:
    """METIS with several balance constraints, ``vweights`` (N, C).

    pymetis's ``part_graph`` passes METIS one constraint (``ncon = 1``), so an
    interleaved (N * C,) array would be read as N single weights of the first half of
    the vertices. Here METIS's own ``METIS_PartGraphRecursive``/``Kway``, exported by
    the library pymetis ships, is called through ctypes with ``ncon = C``; the options
    array is pymetis's, so its option indices are those of the same build.
    """
    from pymetis import _internal

    if recursive is None:  # pymetis's choice
        recursive = num_parts <= 8
    width = getattr(_internal, "_idx_type_width", None)  # (pymetis >= 2025)
    idx_dtype = _idx_dtype(pymetis) if width is None else np.dtype(f"int{width()}")
    try:
        lib = ctypes.CDLL(_internal.__file__)
        entry = lib.METIS_PartGraphRecursive if recursive else lib.METIS_PartGraphKway
    except (OSError, AttributeError) as exc:
        raise RuntimeError(
            f"this pymetis build ({getattr(pymetis, '__version__', '?')}) does not export "
            f"METIS's C functions, which {vweights.shape[1]} balance constraints need "
            f"({exc}); use one constraint (constraints='balanced', the default)") from None
    options.numbering = 0
    opts = np.array([options._get(i) for i in range(_METIS_NOPTIONS)], dtype=idx_dtype)
    num_nodes, ncon = vweights.shape
    scalars = np.array([num_nodes, ncon, num_parts, 0], dtype=idx_dtype)
    arrays = [np.ascontiguousarray(a, dtype=idx_dtype)
              for a in (xadj, adjncy, vweights.reshape(-1))]
    part = np.zeros(num_nodes, dtype=idx_dtype)

    def ptr(a: np.ndarray, at: int = 0) -> ctypes.c_void_p:
        return ctypes.c_void_p(a.ctypes.data + at * a.itemsize)

    entry.restype = ctypes.c_int
    status = entry(ptr(scalars, 0), ptr(scalars, 1), ptr(arrays[0]), ptr(arrays[1]),
                   ptr(arrays[2]), None, None, ptr(scalars, 2), None, None, ptr(opts),
                   ptr(scalars, 3), ptr(part))
    if status != _METIS_OK:
        raise RuntimeError(f"METIS_PartGraph{'Recursive' if recursive else 'Kway'} "
                           f"returned {_METIS_ERRORS.get(status, status)}")
    return part


class _Printed:
    """What was printed to the process's standard output meanwhile (``_catch_stdout``)."""

    text = ""


@contextlib.contextmanager
def _catch_stdout(out: _Printed) -> Iterator[None]:
    """Catch what is printed to the process's standard output, file descriptor 1, into
    ``out.text`` (on an error too): the METIS library's C code prints its messages
    there, which ``_run_metis`` turns into one warning (or the error's text) instead of
    lines in the middle of the output."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (an embedded interpreter): leave it alone
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 1)
        try:
            yield
        finally:
            libc_flush()
            os.dup2(saved, 1)
            os.close(saved)
            caught.seek(0)
            out.text = caught.read().decode(errors="replace")


def libc_flush() -> None:
    """Flush the C library's standard output buffers (METIS prints with printf)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask
        pass


def _spread_isolated(part_of: np.ndarray, xadj: np.ndarray, num_parts: int) -> None:
    """Re-place (in place) the vertices without neighbours to even out part sizes."""
    isolated = np.flatnonzero(_isolated(xadj))
    if not isolated.size:
        return
    kept = np.ones(part_of.size, dtype=bool)
    kept[isolated] = False
    adds = water_fill(np.bincount(part_of[kept], minlength=num_parts), isolated.size)
    part_of[isolated] = np.repeat(np.arange(num_parts, dtype=np.int64), adds)


def _isolated(xadj: np.ndarray) -> np.ndarray:
    """(N,) bool: the vertices without neighbours in the symmetrised graph."""
    return xadj[1:] == xadj[:-1]


def water_fill(counts: np.ndarray, extra: int) -> np.ndarray:
    """(P,) how many of ``extra`` items to add to each bin to even out ``counts``.

    The smallest bins are raised to a common level (differing by at most one), which
    minimises the largest and maximises the smallest final count.
    """
    order = np.argsort(counts, kind="stable")
    ascending = counts[order].astype(np.int64)
    prefix = np.cumsum(ascending)
    levels = (extra + prefix) / np.arange(1, counts.size + 1)
    raised = int(np.flatnonzero(levels >= ascending)[-1]) + 1  # the first always qualifies
    base, remainder = divmod(int(extra + prefix[raised - 1]), raised)
    adds = np.zeros(counts.size, dtype=np.int64)
    adds[order[:raised]] = base - ascending[:raised]
    adds[order[:remainder]] += 1
    return adds


def symmetric_adjacency(graph: Graph) -> tuple[np.ndarray, np.ndarray]:
    """The undirected graph METIS takes: ``u - v`` for every edge, no loops, no repeats.

    Returns:
        ``(xadj, adjncy)``: (N + 1,) and (2 * E_undirected,) int64, neighbours of
        ``v`` in ``adjncy[xadj[v]:xadj[v + 1]]``, sorted.

    Raises:
        ValueError: N >= 2**32 (ids are packed two to a 64-bit sort key).
    """
    num_nodes = graph.num_nodes
    if num_nodes >= 1 << 32:
        raise ValueError(f"graph too large for metis_partition: {num_nodes} vertices "
                         f"(at most {(1 << 32) - 1})")
    src = graph.indices.cpu().numpy().astype(np.uint64)
    dst = np.repeat(np.arange(num_nodes, dtype=np.uint64), graph.in_degrees().cpu().numpy())
    keep = src != dst
    src, dst = src[keep], dst[keep]
    # Key (u << 32) | v: shifts and masks, not the int64 division that u * N + v needs
    # (about 3x faster end to end on 20M edges).
    num = src.size
    keys = np.empty(2 * num, dtype=np.uint64)
    np.left_shift(src, _SHIFT, out=keys[:num])
    keys[:num] |= dst
    np.left_shift(dst, _SHIFT, out=keys[num:])
    keys[num:] |= src
    del src, dst, keep
    keys.sort()  # sort + adjacent-difference mask: np.unique is ~100x slower here
    if keys.size:
        fresh = np.empty(keys.size, dtype=bool)
        fresh[0] = True
        np.not_equal(keys[1:], keys[:-1], out=fresh[1:])
        keys = keys[fresh]
    starts = np.left_shift(np.arange(num_nodes + 1, dtype=np.uint64), _SHIFT)
    xadj = np.searchsorted(keys, starts).astype(np.int64)
    keys &= _LOW_BITS  # in place: the neighbour is the low half of the key
    return xadj, keys.view(np.int64)


def vertex_weights(graph: Graph, constraints: Constraints,
                   xadj: np.ndarray | None = None) -> np.ndarray | None:
    """(N,) int64 vertex weights, (N, C) for C constraints, or None
    (``xadj``: of the symmetrised graph, which tells ``"work"`` the isolated vertices;
    made here if not given)."""
    if constraints == "none":
        return None
    num_nodes = graph.num_nodes
    ones = np.ones(num_nodes, dtype=np.int64)
    if constraints == "vertices":
        return ones
    degree = graph.in_degrees().cpu().numpy().astype(np.int64)
    if not degree.any():
        warnings.warn("metis_partition: the graph has no edges; balancing vertex counts "
                      "only", stacklevel=3)
        return ones
    if constraints == "degree":
        return degree
    if constraints == "work":
        if xadj is None:
            xadj = symmetric_adjacency(graph)[0]
        # isolated vertices weigh nothing to METIS, which leaves them where coarsening
        # put them; they are spread afterwards (``_spread_isolated``)
        return np.where(_isolated(xadj), 0, degree + _vertex_cost(degree))
    return np.stack([ones, degree], axis=1)


def _import_pymetis() -> Any:
    try:
        import pymetis
    except ImportError:
        raise ImportError("METIS partitioning needs pymetis, a dependency of fullgraph that "
                          "is not installed: pip install pymetis") from None
    return pymetis


def _idx_dtype(pymetis: Any) -> np.dtype:
    """The integer dtype METIS was built with (arrays of it are passed without a copy)."""
    zero_copy = getattr(pymetis, "zero_copy_dtype", None)
    return np.dtype(np.int64) if zero_copy is None else zero_copy()
