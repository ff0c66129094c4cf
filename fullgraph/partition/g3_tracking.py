"""Fast neighbour tracking for G3's iterative partitioner (G3 §4.2).

The counters, bucket lists and move kernels behind ``fullgraph.partition.g3``; see
that module's docstring for what they track and why. The kernels are plain Python
functions compiled with numba when it is installed; the same bodies run uncompiled
otherwise (same results, slowly).

This module must not import torch.distributed or anything above the partition layer.
"""
from __future__ import annotations

import types
from typing import Any, Callable, NamedTuple

import numpy as np

from fullgraph.graph.csr import Graph

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
    count: np.ndarray  # type: ignore[assignment]  # shadows tuple.count on purpose
    xor: np.ndarray
    private: np.ndarray
    fresh: np.ndarray
    remote: np.ndarray
    gain: Buckets
    cost: Buckets


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
        nxt, prv, at = (np.full((num_layers, num_nodes), -1, dtype=np.int32) for _ in range(3))
        return Buckets(np.full((num_lists, NUM_BUCKETS), -1, dtype=np.int32), nxt, prv, at,
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
        raise ValueError("use_numba=True but numba is not installed: pip install "
                         "'fullgraph[fast]', or pass use_numba=False")
    if use_numba is False or JIT_KERNELS is None:
        return PY_KERNELS
    return JIT_KERNELS
