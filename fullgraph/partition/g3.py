"""G3's locality-aware iterative partitioner (Wan et al., G3, section 4.2, Algorithm 1).

Stage 1 is a multi-constraint METIS partition, weights ``(1, in_degree)``: it balances
|V_i| and the in-edges of every part (G3 equations 1-2) while minimising the cut (a
proxy for equation 3). Stage 2 balances |V_i^remote|, the distinct vertices outside
part ``i`` with an out-edge into it (equation 4): while ``min_i |V_i^remote| <
(1 - threshold) * max_i |V_i^remote|`` it takes the part ``a`` with the most remote
vertices and the part ``b`` with the fewest (lowest index on ties) and swaps a vertex
of ``a`` with one of ``b``, so every |V_i| keeps its stage-1 value exactly.

How Algorithm 1 is read here (the paper leaves these open):

- Line 10, "remote neighbours of v", is the exact drop of |V_a^remote| when ``v``
  leaves ``a``: the in-neighbours ``u`` of ``v`` outside ``a`` whose only out-edge
  into ``a`` goes to ``v``, minus 1 when ``v`` itself then becomes remote to ``a``.
  (The raw count of remote in-neighbours overstates the effect whenever other
  vertices of ``a`` share them, as R-MAT hubs' in-neighbours mostly are.)
- Line 11, |N(v) - V_max|, is the exact growth of |V_a^remote| if ``v`` joins ``a``:
  in-neighbours of ``v`` outside ``a`` not yet remote to ``a``, minus 1 when ``v`` is
  remote to ``a`` now. ``v_min`` is the vertex of ``b`` minimising it.
- ``v_max`` is chosen among the ``candidates`` vertices of ``a`` with the highest
  line-10 score: those predicted to lower ``max(|V_a^remote|, |V_b^remote|)`` are
  tried in order of the remote vertices they add to ``b`` per remote vertex they take
  from ``a`` (fewest first). ``candidates=1`` is the literal line 10; over METIS
  partitions of Cora, Coauthor CS and a 3000-vertex R-MAT graph (P = 2..16, 3 seeds)
  it missed "max/min closer to 1 than METIS, total at most 10% above" 15 times in
  45, against 5 with 64 candidates (all on the total: +11% on Cora at P = 8, +36
  to 43% on the R-MAT graph at P = 16, where METIS's max/min is 5 to 6).
- Cycles: a swap is kept only when it lowers ``max(|V_a^remote|, |V_b^remote|)``
  below the old maximum, else it is undone and the next candidate is tried; when none
  is left stage 2 stops (``"no_improvement"``). Each kept swap lowers the descending
  sorted vector of |V_i^remote| lexicographically, so no state can recur.
- In-edges are not re-balanced by stage 2 (the paper gives no bound):
  ``quality(graph, book).ratio("edges")`` reports them.

Fast neighbour tracking (section 4.2): ``count[i, u]`` is the number of out-edges of
``u`` into part ``i`` (the paper's in-partition degree), so ``u`` is in V_i^remote iff
``part[u] != i and count[i, u] > 0``. ``xor[i, u]``, the XOR of those out-neighbours,
names the last one when ``count[i, u] == 1``, so the line-10 scores stay exact with
O(1) work per changed counter. Moving ``v`` from ``a`` to ``b`` costs O(d_in(v) +
d_out(v) + P) updates, plus d_out(u) for each in-neighbour ``u`` that enters or leaves
the remote set of ``a`` or ``b`` (the line-11 scores of ``u``'s out-neighbours move).
The scores live in bucket lists, FM-style (one per part for line 10, one per ordered
pair of parts for line 11; keys above ``NUM_BUCKETS - 2`` share the last bucket,
which is scanned), so a pick is O(1) amortised and an iteration is O(candidates)
plus its moves: two, and four more per tried swap that is undone. Memory: O(P * N)
int32 counters and list links, and both adjacencies.

Self-loops and repeated edges change no remote set and are dropped first. Stage 2 is
deterministic: ``seed`` only reaches stage 1. It runs compiled with numba when
installed; otherwise the same kernels run as plain Python (same result, slow).

This module must not import torch.distributed or anything above the partition layer.

Shapes: N = number of vertices, E = number of edges, P = number of parts.
"""
from __future__ import annotations

import time
import types
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from fullgraph.graph.csr import Graph
from fullgraph.partition import register_partitioner
from fullgraph.partition.book import PartitionBook, check_num_parts

try:
    import numba
except ImportError:  # numba is optional (the "fast" extra); Python runs the same kernels
    numba = None  # type: ignore[assignment]

NUM_BUCKETS = 64  # score buckets per list; scores >= NUM_BUCKETS - 2 share the last one
CHUNK_SWAPS = 256  # swaps per kernel call between checks of max_seconds
STOP_REASONS = ("converged", "no_improvement", "no_candidate", "max_moves", "max_seconds")
_BUDGET = 3  # kernel return code: max_swaps done, not stopped


class Adjacency(NamedTuple):
    """Both CSRs without self-loops or repeated edges: int64 offsets, int32 ids."""

    in_ptr: np.ndarray
    in_idx: np.ndarray
    out_ptr: np.ndarray
    out_idx: np.ndarray


class Buckets(NamedTuple):
    """S bucket lists over L layers of N vertex slots (doubly linked, LIFO buckets).

    Attributes: head (S, B) first vertex of each bucket or -1; nxt, prv, at (L, N)
    links and bucket of each vertex (-1: in no list); key (L, N) exact score;
    bound (S,) where the search starts (every bucket beyond it is empty).
    """

    head: np.ndarray
    nxt: np.ndarray
    prv: np.ndarray
    at: np.ndarray
    key: np.ndarray
    bound: np.ndarray


class Tracker(NamedTuple):
    """Incremental remote-vertex counters of one partition (see the module docstring).

    Attributes:
        part: (N,) int32 part of each vertex.
        count: (P, N) int32, out-edges of ``u`` into part ``i``.
        xor: (P, N) int32, XOR of those out-neighbours.
        private: (N,) int32, in-neighbours ``u`` of ``v`` outside ``part[v]`` whose
            only out-edge into ``part[v]`` goes to ``v``.
        fresh: (P, N) int32, in-neighbours ``u`` of ``v`` outside ``i`` with
            ``count[i, u] == 0``.
        remote: (P,) int64, |V_i^remote|.
        gain: line-10 lists, one per part (S = P, L = 1), key
            ``private[v] - (count[part[v], v] > 0)``.
        cost: line-11 lists, one per (own part, target ``t``) pair (S = P * P,
            L = P), key ``fresh[t, v] - (count[t, v] > 0)`` in layer ``t``.
    """

    part: np.ndarray
    count: np.ndarray
    xor: np.ndarray
    private: np.ndarray
    fresh: np.ndarray
    remote: np.ndarray
    gain: Buckets
    cost: Buckets


@dataclass(frozen=True)
class RefineStats:
    """What stage 2 did.

    Attributes:
        swaps: iterations of Algorithm 1 kept (each moves two vertices).
        stop: why it stopped, one of ``STOP_REASONS``.
        remote_before, remote_after: (P,) |V_i^remote| before and after.
        seconds: wall time of stage 2, setup included.
    """

    swaps: int
    stop: str
    remote_before: tuple[int, ...]
    remote_after: tuple[int, ...]
    seconds: float


# ----------------------------------------------------------------- entry points
@register_partitioner("g3")
def g3_partition(graph: Graph, num_parts: int, *, seed: int = 0, threshold: float = 0.005,
                 max_moves: int | None = None, max_seconds: float | None = None,
                 stage1: str = "metis", candidates: int = 64,
                 use_numba: bool | None = None) -> PartitionBook:
    """Partition with G3's two stages: multi-constraint METIS, then remote balancing.

    The part sizes are exactly stage 1's: swaps never change them.

    Args:
        graph: a square graph.
        num_parts: P, with ``1 <= P <= N``.
        seed: seed of stage 1; stage 2 is deterministic (default: 0).
        threshold: stop once ``min/max`` of |V_i^remote| is at least
            ``1 - threshold`` (default: 0.005, the paper's 0.5%).
        max_moves: at most this many swaps (default: None, no limit).
        max_seconds: stop stage 2 after about this long (default: None, no limit).
        stage1: the registered partitioner of stage 1 (default: ``"metis"``, whose
            default weights are G3's ``(1, in_degree)``).
        candidates: top-scored vertices of the busiest part considered per swap;
            1 is the paper's literal rule (default: 64).
        use_numba: run stage 2 compiled (default: None, when numba is installed).

    Raises:
        ValueError: ``num_parts`` out of range, a bad option, or ``use_numba=True``
            without numba.
    """
    check_num_parts(num_parts, graph.num_nodes)
    _check_options(threshold, max_moves, max_seconds, candidates)
    book = _stage1(graph, num_parts, seed, stage1)
    refined, _ = g3_refine(graph, book, threshold=threshold, max_moves=max_moves,
                           max_seconds=max_seconds, candidates=candidates,
                           use_numba=use_numba)
    return refined


def g3_refine(graph: Graph, book: PartitionBook, *, threshold: float = 0.005,
              max_moves: int | None = None, max_seconds: float | None = None,
              candidates: int = 64,
              use_numba: bool | None = None) -> tuple[PartitionBook, RefineStats]:
    """Stage 2 alone (Algorithm 1, lines 3-14), starting from ``book``.

    Args and Raises: as ``g3_partition``; ``book`` must cover the graph's vertices.

    Returns:
        The refined book (the part sizes of ``book``) and what stage 2 did.
    """
    start = time.perf_counter()
    _check_options(threshold, max_moves, max_seconds, candidates)
    kernels = select_kernels(use_numba)
    if book.num_nodes != graph.num_nodes:
        raise ValueError(f"partition book has {book.num_nodes} vertices, the graph "
                         f"{graph.num_nodes}; partition this graph")
    adj = adjacency(graph)
    tracker = build_tracker(adj, book.part_of.numpy(), book.num_parts, kernels)
    before = tuple(int(r) for r in tracker.remote)
    swaps, stop = 0, "converged"
    while book.num_parts > 1:
        budget = CHUNK_SWAPS if max_moves is None else min(CHUNK_SWAPS, max_moves - swaps)
        if budget <= 0:
            stop = "max_moves"
            break
        done, code = kernels.run(adj, tracker, float(threshold), budget, int(candidates))
        swaps += int(done)
        if code != _BUDGET:
            stop = STOP_REASONS[code]
            break
        if max_seconds is not None and time.perf_counter() - start >= max_seconds:
            stop = "max_seconds"
            break
    refined = PartitionBook.from_assignment(tracker.part.astype(np.int64), book.num_parts)
    return refined, RefineStats(swaps=swaps, stop=stop, remote_before=before,
                                remote_after=tuple(int(r) for r in tracker.remote),
                                seconds=time.perf_counter() - start)


def _stage1(graph: Graph, num_parts: int, seed: int, stage1: str) -> PartitionBook:
    from fullgraph.partition import PARTITIONERS  # looked up per call, as partition() does

    if stage1 == "g3" or stage1 not in PARTITIONERS:
        known = ", ".join(sorted(set(PARTITIONERS) - {"g3"}))
        raise ValueError(f"stage1 must be a registered partitioner other than 'g3' "
                         f"({known}), got {stage1!r}")
    return PARTITIONERS[stage1](graph, num_parts, seed=seed)


def _check_options(threshold: float, max_moves: int | None, max_seconds: float | None,
                   candidates: int) -> None:
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold must satisfy 0 <= threshold < 1, got {threshold}")
    if max_moves is not None and max_moves < 0:
        raise ValueError(f"max_moves must be >= 0 or None, got {max_moves}")
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"max_seconds must be > 0 or None, got {max_seconds}")
    if candidates < 1:
        raise ValueError(f"candidates must be >= 1 (1: the paper's rule), got {candidates}")


# ------------------------------------------------------------------ tracking
def adjacency(graph: Graph) -> Adjacency:
    """Both CSRs of ``graph`` without self-loops or repeated edges.

    Raises:
        ValueError: the graph is bipartite or has 2**31 vertices or more.
    """
    num_nodes = graph.num_nodes
    if num_nodes >= 1 << 31:
        raise ValueError(f"graph too large for g3: {num_nodes} vertices (at most 2**31 - 1)")
    src = graph.indices.cpu().numpy().astype(np.int32, copy=False)
    dst = np.repeat(np.arange(num_nodes, dtype=np.int32), graph.in_degrees().cpu().numpy())
    keep = src != dst
    keep[1:] &= (src[1:] != src[:-1]) | (dst[1:] != dst[:-1])  # sources sorted in a row
    src, dst = src[keep], dst[keep]
    order = np.argsort(src, kind="stable")
    return Adjacency(_offsets(np.bincount(dst, minlength=num_nodes)), src,
                     _offsets(np.bincount(src, minlength=num_nodes)), dst[order])


def _offsets(counts: np.ndarray) -> np.ndarray:
    ptr = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ptr


def recount(adj: Adjacency, part: np.ndarray, num_parts: int) -> dict[str, np.ndarray]:
    """``count``, ``xor``, ``private``, ``fresh`` and ``remote`` of ``part`` from scratch.

    Vectorised, O(P * E); a tracker equals this after any sequence of moves.
    """
    num_nodes = part.size
    part = part.astype(np.int64)
    src = adj.in_idx.astype(np.int64)
    dst = np.repeat(np.arange(num_nodes, dtype=np.int64), np.diff(adj.in_ptr))
    src_part, dst_part = part[src], part[dst]
    key = dst_part * num_nodes + src
    count = np.bincount(key, minlength=num_parts * num_nodes)
    xor = np.zeros(num_parts * num_nodes, dtype=np.int64)
    np.bitwise_xor.at(xor, key, dst)
    alone = (src_part != dst_part) & (count[key] == 1)
    count = count.reshape(num_parts, num_nodes)
    fresh = np.empty((num_parts, num_nodes), dtype=np.int32)
    for i in range(num_parts):
        fresh[i] = np.bincount(dst[(src_part != i) & (count[i, src] == 0)], minlength=num_nodes)
    outside = part[None, :] != np.arange(num_parts)[:, None]
    return {"count": count.astype(np.int32), "xor": xor.reshape(num_parts, -1).astype(np.int32),
            "private": np.bincount(dst[alone], minlength=num_nodes).astype(np.int32),
            "fresh": fresh, "remote": ((count > 0) & outside).sum(axis=1).astype(np.int64)}


def build_tracker(adj: Adjacency, part_of: np.ndarray, num_parts: int,
                  kernels: Kernels) -> Tracker:
    """The tracker of the assignment ``part_of``, every vertex in its score lists."""
    num_nodes = part_of.size

    def lists(num_lists: int, num_layers: int, bound: int) -> Buckets:
        links = [np.full((num_layers, num_nodes), -1, dtype=np.int32) for _ in range(3)]
        return Buckets(np.full((num_lists, NUM_BUCKETS), -1, dtype=np.int32), *links,
                       np.zeros((num_layers, num_nodes), dtype=np.int32),
                       np.full(num_lists, bound, dtype=np.int64))

    tracker = Tracker(part=part_of.astype(np.int32), gain=lists(num_parts, 1, -1),
                      cost=lists(num_parts * num_parts, num_parts, NUM_BUCKETS),
                      **recount(adj, part_of, num_parts))
    kernels.attach_all(tracker)
    return tracker


# ------------------------------------------------------------------- kernels
# Plain Python on numpy arrays, compiled by ``_compile`` when numba is installed.
def _place(bk, s, layer, v, key, top):
    """Put ``v`` (in list ``s`` or in none) in the bucket of ``key``."""
    k = min(key + 1, bk.head.shape[1] - 1)  # keys are >= -1
    bk.key[layer, v] = key
    if bk.at[layer, v] == k:
        return
    if bk.at[layer, v] >= 0:
        _unlink(bk, s, layer, v)
    first = bk.head[s, k]
    bk.nxt[layer, v] = first
    bk.prv[layer, v] = -1
    if first >= 0:
        bk.prv[layer, first] = v
    bk.head[s, k] = v
    bk.at[layer, v] = k
    bk.bound[s] = max(bk.bound[s], k) if top else min(bk.bound[s], k)


def _unlink(bk, s, layer, v):
    nxt, prv = bk.nxt[layer, v], bk.prv[layer, v]
    if prv >= 0:
        bk.nxt[layer, prv] = nxt
    else:
        bk.head[s, bk.at[layer, v]] = nxt
    if nxt >= 0:
        bk.prv[layer, nxt] = prv
    bk.at[layer, v] = -1


def _pick(bk, s, layer, top):
    """The vertex of list ``s`` with the largest (``top``) or smallest key, or -1."""
    nb, k, step = bk.head.shape[1], bk.bound[s], -1 if top else 1
    while 0 <= k < nb and bk.head[s, k] < 0:
        k += step
    bk.bound[s] = k
    if not 0 <= k < nb:
        return -1
    best = v = bk.head[s, k]
    while k == nb - 1 and v >= 0:  # the shared last bucket: scan for the extreme
        diff = bk.key[layer, v] - bk.key[layer, best]
        if (top and diff > 0) or (not top and diff < 0):
            best = v
        v = bk.nxt[layer, v]
    return best


def _regain(st, v):
    a = st.part[v]
    _place(st.gain, a, 0, v, st.private[v] - (1 if st.count[a, v] > 0 else 0), True)


def _recost(st, t, v):
    a = st.part[v]
    if a != t:
        key = st.fresh[t, v] - (1 if st.count[t, v] > 0 else 0)
        _place(st.cost, a * st.count.shape[0] + t, t, v, key, False)


def _shift_fresh(adj, st, t, u, delta):
    for e in range(adj.out_ptr[u], adj.out_ptr[u + 1]):
        w = adj.out_idx[e]
        st.fresh[t, w] += delta
        _recost(st, t, w)


def _bump_private(st, w, delta):
    st.private[w] += delta
    _regain(st, w)


def _leave(adj, st, u, v, a):
    """The edge ``u -> v`` stops pointing into part ``a``."""
    st.count[a, u] -= 1
    st.xor[a, u] ^= v
    left = st.count[a, u]
    if st.part[u] == a:
        if left == 0:
            _regain(st, u)
    elif left == 0:
        st.remote[a] -= 1
        _shift_fresh(adj, st, a, u, 1)
        _recost(st, a, u)
    elif left == 1:
        _bump_private(st, st.xor[a, u], 1)


def _enter(adj, st, u, v, b):
    """The edge ``u -> v`` starts pointing into part ``b``."""
    old = st.count[b, u]
    if st.part[u] != b and old == 1:
        _bump_private(st, st.xor[b, u], -1)
    st.count[b, u] = old + 1
    st.xor[b, u] ^= v
    if old == 0:
        if st.part[u] == b:
            _regain(st, u)
        else:
            st.remote[b] += 1
            _shift_fresh(adj, st, b, u, -1)
            _recost(st, b, u)


def _as_source(adj, st, v, a, b):
    """Updates for ``v``'s own out-edges when ``v`` leaves ``a`` for ``b``."""
    if st.count[b, v] > 0:
        st.remote[b] -= 1
        if st.count[b, v] == 1:
            _bump_private(st, st.xor[b, v], -1)
    else:
        _shift_fresh(adj, st, b, v, -1)
    if st.count[a, v] > 0:
        st.remote[a] += 1
        if st.count[a, v] == 1:
            _bump_private(st, st.xor[a, v], 1)
    else:
        _shift_fresh(adj, st, a, v, 1)


def _attach(adj, st, v):
    """Recompute ``private[v]`` and put ``v`` in the lists of its part."""
    b = st.part[v]
    private = 0
    for e in range(adj.in_ptr[v], adj.in_ptr[v + 1]):
        u = adj.in_idx[e]
        if st.part[u] != b and st.count[b, u] == 1:
            private += 1
    st.private[v] = private
    _regain(st, v)
    for t in range(st.count.shape[0]):
        _recost(st, t, v)


def _move(adj, st, v, b):
    """Move ``v`` to part ``b``, updating every counter and list."""
    a = st.part[v]
    num_parts = st.count.shape[0]
    _unlink(st.gain, a, 0, v)
    for t in range(num_parts):
        if t != a:
            _unlink(st.cost, a * num_parts + t, t, v)
    _as_source(adj, st, v, a, b)
    st.part[v] = b
    for e in range(adj.in_ptr[v], adj.in_ptr[v + 1]):
        _leave(adj, st, adj.in_idx[e], v, a)
        _enter(adj, st, adj.in_idx[e], v, b)
    _attach(adj, st, v)


def _attach_all(st):
    for v in range(st.part.shape[0]):
        _regain(st, v)
        for t in range(st.count.shape[0]):
            _recost(st, t, v)


def _candidates(st, a, b, v_min, width, cand, score):
    """Top-``width`` scored vertices of ``a`` predicted to improve, in trial order."""
    gain, high, low = st.gain, st.remote[a], st.remote[b]
    c_in, g_out = st.cost.key[a, v_min], gain.key[0, v_min]
    n, seen, k = 0, 0, gain.bound[a]
    while k >= 0 and seen < width:
        v = gain.head[a, k]
        while v >= 0 and seen < width:
            g, c_out = gain.key[0, v], st.cost.key[b, v]
            if max(high - g + c_in, low + c_out - g_out) < high:
                cand[n] = v
                score[n] = c_out / max(g, 1)  # remote added to b per remote taken from a
                n += 1
            seen += 1
            v = gain.nxt[0, v]
        k -= 1
    return cand[:n][np.argsort(score[:n], kind="mergesort")]


def _run(adj, st, threshold, max_swaps, width):
    """Up to ``max_swaps`` iterations of Algorithm 1; returns (swaps, stop code)."""
    num_parts = st.count.shape[0]
    cand = np.empty(width, dtype=np.int64)
    score = np.empty(width, dtype=np.float64)
    for it in range(max_swaps):
        a, b = np.argmax(st.remote), np.argmin(st.remote)
        high = st.remote[a]
        if high - st.remote[b] <= threshold * high:
            return it, 0
        v_min = _pick(st.cost, b * num_parts + a, a, False)
        if v_min < 0 or _pick(st.gain, a, 0, True) < 0:
            return it, 2
        kept = False
        for v_max in _candidates(st, a, b, v_min, width, cand, score):
            _move(adj, st, v_max, b)
            _move(adj, st, v_min, a)
            kept = max(st.remote[a], st.remote[b]) < high
            if kept:
                break
            _move(adj, st, v_min, b)  # not better after all: undo, try the next one
            _move(adj, st, v_max, a)
        if not kept:
            return it, 1
    return max_swaps, _BUDGET


class Kernels(NamedTuple):
    """The kernel entry points, compiled or in Python."""

    run: Callable[..., Any]
    move: Callable[..., Any]
    attach_all: Callable[..., Any]


_KERNELS = ("_place", "_unlink", "_pick", "_regain", "_recost", "_shift_fresh", "_bump_private",
            "_leave", "_enter", "_as_source", "_attach", "_move", "_attach_all", "_candidates",
            "_run")


def _compile() -> Kernels:
    """numba versions of the kernels; the Python ones stay as they are.

    Each kernel is cloned with a globals dict in which the other kernels' names are
    their compiled versions (numba resolves a callee by its global name when it
    compiles the caller), so one body serves both backends.
    """
    assert numba is not None
    env = dict(globals())
    for name in _KERNELS:
        clone = types.FunctionType(globals()[name].__code__, env, name)
        env[name] = numba.njit(cache=True)(clone)
    return Kernels(env["_run"], env["_move"], env["_attach_all"])


PY_KERNELS = Kernels(_run, _move, _attach_all)
JIT_KERNELS = _compile() if numba is not None else None  # compiled on first call


def select_kernels(use_numba: bool | None) -> Kernels:
    """The compiled kernels (default when numba is installed) or the Python ones.

    Raises:
        ValueError: ``use_numba=True`` but numba is not installed.
    """
    if use_numba and JIT_KERNELS is None:
        raise ValueError("use_numba=True but numba is not installed: pip install numba "
                         "(or fullgraph's 'fast' extra), or pass use_numba=False")
    if use_numba is False or JIT_KERNELS is None:
        return PY_KERNELS
    return JIT_KERNELS
