"""SpMM over a graph cut into destination chunks, streamed to a compute device.

The graph and the dense rows stay in host memory (pinned when the device is a GPU);
each chunk's CSR, the source rows it reads and its output rows are copied to the
device, aggregated there and copied back (NeutronTP §4.2.1). The backward streams
the same chunks: each chunk's transposed product gives gradients for the chunk's
source rows, which are summed into the host gradient (copies of a source in
several chunks add up, by associativity). On the CPU the "device" is the host and
the same code runs; the ``MemoryAccount`` then enforces the budget.

On a GPU with ``prefetch`` (NeutronTP §4.2.1's overlap of transfer and
computation), a helper thread gathers the next chunk's source rows into pinned
host memory and copies them, with the chunk's CSR (pinned once), to the device on a
side CUDA stream while the current chunk computes; the compute stream waits on an
event for each chunk's inputs. Two chunks' inputs are then on the device at once,
so the caller cuts chunks to half the budget. The sums are the same as without it.

A chunk is a set of destinations given as one or more contiguous ranges. Tensor
parallelism gives every chunk a slice of every worker's row block (NeutronTP
Algorithm 1, line 2), so each chunk's exchange is a balanced all-to-all rather than
a transfer to the one worker that owns a contiguous chunk.

Shapes: N_dst, N_src vertices, E edges, D columns; chunk k has R_k rows, E_k edges
and S_k distinct sources.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import numpy as np
import torch
from torch import Tensor

from fullgraph.graph.csr import Graph, same_device
from fullgraph.memory import MemoryAccount
from fullgraph.ops.spmm import aggregate, edge_dot

Ranges = list[tuple[int, int]]


@dataclass
class Chunk:
    """Destinations in ``ranges`` (ascending, disjoint) with all their in-edges.

    Attributes:
        ranges: destination ranges ``[start, stop)``; the chunk's rows are their
            concatenation, in this order.
        edge_ranges: the matching ranges of edge positions in the graph's CSR.
        graph: CSR of the chunk with sources renumbered 0..S_k-1 (host memory).
        src: (S_k,) global ids of the chunk's distinct sources, ascending.
    """

    ranges: Ranges
    edge_ranges: Ranges
    graph: Graph
    src: Tensor
    _pinned: dict[str, Graph] = field(default_factory=dict, repr=False)

    def graph_on(self, device: torch.device, transposed: bool = False) -> Graph:
        """The chunk's CSR (or its transpose's) on ``device``; for a GPU it is copied
        from a pinned host copy made once, without blocking the host."""
        g = self.graph.transpose().graph if transposed else self.graph
        if device.type != "cuda":
            return g.to(device)
        key = "t" if transposed else "g"
        if key not in self._pinned:
            self._pinned[key] = Graph(g.indptr.pin_memory(), g.indices.pin_memory(),
                                      g.num_src, validate=False)
        p = self._pinned[key]
        return Graph(p.indptr.to(device, non_blocking=True),
                     p.indices.to(device, non_blocking=True), p.num_src, validate=False)

    def take(self, t: Tensor) -> Tensor:
        """The chunk's rows of a destination-indexed tensor (a view for one range)."""
        return take_ranges(t, self.ranges)

    def put(self, t: Tensor, values: Tensor) -> None:
        """``t[rows] = values`` for the chunk's (R_k, ...) ``values``."""
        put_ranges(t, self.ranges, values)

    def take_edges(self, w: Tensor) -> Tensor:
        """The chunk's entries of a CSR-ordered (E, ...) edge tensor."""
        return take_ranges(w, self.edge_ranges)

    def add_edges(self, t: Tensor, values: Tensor) -> None:
        """``t[chunk edges] += values``."""
        o = 0
        for a, b in self.edge_ranges:
            t[a:b] += values[o:o + b - a]
            o += b - a

    def parts_in(self, lo: int, hi: int) -> Ranges:
        """The chunk's destination ranges clipped to ``[lo, hi)`` (empty ones dropped)."""
        out = [(max(a, lo), min(b, hi)) for a, b in self.ranges]
        return [(a, b) for a, b in out if b > a]


def take_ranges(t: Tensor, ranges: Ranges, shift: int = 0) -> Tensor:
    """Rows ``[a - shift, b - shift)`` of ``t`` for each range, concatenated."""
    if len(ranges) == 1:
        a, b = ranges[0]
        return t[a - shift:b - shift]
    return torch.cat([t[a - shift:b - shift] for a, b in ranges]) if ranges else t[:0]


def put_ranges(t: Tensor, ranges: Ranges, values: Tensor, shift: int = 0) -> None:
    """The inverse of ``take_ranges``: write ``values`` into those rows of ``t``."""
    o = 0
    for a, b in ranges:
        t[a - shift:b - shift] = values[o:o + b - a]
        o += b - a


def build_chunks(graph: Graph, chunks: list[Ranges] | Ranges) -> list[Chunk]:
    """Cut ``graph`` into chunks of destination ranges (views + renumbering).

    Args:
        graph: the whole graph (CSR by destination).
        chunks: per chunk, a list of ``(start, stop)`` ranges, or one ``(start, stop)``
            pair per chunk for contiguous chunks.
    """
    indptr = graph.indptr.cpu().numpy().astype(np.int64)
    indices = graph.indices.cpu().numpy()
    out = []
    for spec in chunks:
        ranges = [spec] if isinstance(spec[0], (int, np.integer)) else list(spec)
        ranges = [(int(a), int(b)) for a, b in ranges if b > a]
        edge_ranges = [(int(indptr[a]), int(indptr[b])) for a, b in ranges]
        ptr = [np.zeros(1, dtype=np.int64)]
        for a, b in ranges:
            ptr.append(indptr[a + 1:b + 1] - indptr[a] + ptr[-1][-1])
        src_global = np.concatenate([indices[e0:e1] for e0, e1 in edge_ranges]) \
            if ranges else indices[:0]
        src, local = np.unique(src_global, return_inverse=True)
        sub = Graph(torch.from_numpy(np.concatenate(ptr)),
                    torch.from_numpy(local.astype(np.int64)), num_src=int(src.size),
                    validate=False)
        out.append(Chunk(ranges, edge_ranges, sub, torch.from_numpy(src.astype(np.int64))))
    return out


def chunked_spmm(chunks: list[Chunk], num_dst: int, x: Tensor, weight: Tensor | None,
                 device: torch.device, account: MemoryAccount | None = None,
                 prefetch: bool = False) -> Tensor:
    """``out[i] = sum_e weight[e] x[src_e]`` computed chunk by chunk on ``device``.

    Args:
        chunks: from ``build_chunks``; they cover destinations 0..num_dst-1.
        num_dst: N_dst.
        x: (N_src, D) source rows (host memory, or already on ``device``).
        weight: None or (E,) edge weights in the graph's CSR order.
        device: where each chunk is computed.
        account: records the device bytes each chunk holds (default: None).
        prefetch: on a GPU, load the next chunk on a side stream while this one
            computes (module docstring) (default: False).

    Returns:
        (N_dst, D) on ``x``'s device, differentiable in ``x`` and ``weight``.
    """
    return _ChunkedSpMM.apply(x, weight, chunks, num_dst, device, account, prefetch)


@overload
def _to(t: Tensor, device: torch.device) -> Tensor: ...


@overload
def _to(t: None, device: torch.device) -> None: ...


def _to(t: Tensor | None, device: torch.device) -> Tensor | None:
    if t is None or same_device(t.device, device):
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _gather(x: Tensor, rows: Tensor, device: torch.device) -> Tensor:
    """``x[rows]`` on ``device``; from host to a GPU through a pinned buffer (gathered
    straight into it) and a copy that does not block the host."""
    if x.device.type == "cpu" and device.type == "cuda":
        buf = torch.empty((rows.numel(),) + tuple(x.shape[1:]), dtype=x.dtype,
                          pin_memory=True)
        torch.index_select(x, 0, rows, out=buf)
        return buf.to(device, non_blocking=True)
    return _to(x.index_select(0, rows.to(x.device)), device)


T = TypeVar("T")


def streamed(chunks: Sequence[Chunk], load: Callable[[Chunk], T], device: torch.device,
             account: MemoryAccount | None = None,
             prefetch: bool = False) -> Iterator[tuple[Chunk, T]]:
    """``(c, load(c))`` for each chunk in turn; on a GPU with ``prefetch``, the next
    chunk is loaded by a helper thread on a side stream while the caller computes
    this one (module docstring). Tensors in what ``load`` returns (a tensor, a
    ``Graph`` or a tuple of them) are made safe to use on the compute stream."""
    if not (prefetch and device.type == "cuda" and len(chunks) > 1):
        for c in chunks:
            yield c, load(c)
        return
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    inputs_ready = main.record_event()  # what ``load`` reads was written on ``main``

    def job(c: Chunk) -> tuple[T, Any]:
        with torch.cuda.device(device), torch.cuda.stream(side):
            side.wait_event(inputs_ready)
            data = load(c)
            return data, side.record_event()

    with ThreadPoolExecutor(1, thread_name_prefix="fullgraph-prefetch") as pool:
        pending = pool.submit(job, chunks[0])
        for i, c in enumerate(chunks):
            data, ready = pending.result()
            if i + 1 < len(chunks):
                pending = pool.submit(job, chunks[i + 1])
            main.wait_event(ready)
            tensors = list(_tensors(data))
            for t in tensors:
                t.record_stream(main)
            # the next chunk's inputs are on the device meanwhile: about as large
            ahead = _hold(account, *tensors) if i + 1 < len(chunks) else 0
            yield c, data
            _release(account, ahead)


def _tensors(data: Any) -> Iterator[Tensor]:
    if isinstance(data, Tensor):
        yield data
    elif isinstance(data, Graph):
        yield data.indptr
        yield data.indices
    elif isinstance(data, tuple):
        for d in data:
            yield from _tensors(d)


class _ChunkedSpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, chunks: list[Chunk], num_dst: int,
                device: torch.device, account: MemoryAccount | None,
                prefetch: bool) -> Tensor:
        ctx.chunks, ctx.device, ctx.account, ctx.num_src = chunks, device, account, x.shape[0]
        ctx.save_for_backward(x if weight is not None and weight.requires_grad else None, weight)
        out = torch.empty(num_dst, x.shape[1], dtype=x.dtype, device=x.device)
        ctx.prefetch = prefetch
        inputs = (lambda c: load_aggregate(c, x, weight, device))  # noqa: E731
        for c, loaded in streamed(chunks, inputs, device, account, prefetch):
            c.put(out, chunk_aggregate(c, x, weight, device, account, loaded))
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]
        grad_x = grad_w = None
        if need_x:
            grad_x = torch.zeros(ctx.num_src, grad_out.shape[1], dtype=grad_out.dtype,
                                 device=grad_out.device)
        if need_w:
            grad_w = torch.zeros_like(weight)
        device = ctx.device
        inputs = (lambda c: _to(c.take(grad_out).contiguous(), device))  # noqa: E731
        for c, gout in streamed(ctx.chunks, inputs, device, ctx.account, ctx.prefetch):
            chunk_backward(c, gout, x, weight, grad_x, grad_w, device, ctx.account)
        return grad_x, grad_w, None, None, None, None, None


def load_aggregate(c: Chunk, x: Tensor, weight: Tensor | None,
                   device: torch.device) -> tuple[Graph, Tensor | None, Tensor]:
    """Chunk ``c``'s inputs on ``device``: its CSR, its edge weights and source rows."""
    g = c.graph_on(device)
    w = _to(None if weight is None else c.take_edges(weight.detach()), device)
    return g, w, _gather(x.detach(), c.src, device)


def chunk_aggregate(c: Chunk, x: Tensor, weight: Tensor | None, device: torch.device,
                    account: MemoryAccount | None = None,
                    loaded: tuple[Graph, Tensor | None, Tensor] | None = None) -> Tensor:
    """(R_k, D) output rows of chunk ``c`` (on ``x``'s device), computed on ``device``.

    ``weight`` is the whole graph's (E,) weights; the chunk takes its edge range.
    ``loaded``: what ``load_aggregate`` returned for it, when already loaded.
    """
    g, w, xs = loaded if loaded is not None else load_aggregate(c, x, weight, device)
    held = _hold(account, g.indptr, g.indices, xs, w)
    res = aggregate(g, xs, w, "sum")
    held += _hold(account, res)
    out = res.to(x.device)
    _release(account, held)
    return out


def chunk_backward(c: Chunk, grad_rows: Tensor, x: Tensor | None, weight: Tensor | None,
                   grad_x: Tensor | None, grad_w: Tensor | None, device: torch.device,
                   account: MemoryAccount | None = None) -> None:
    """Add chunk ``c``'s share of the gradients: ``grad_x[src] += A_k^T grad_rows`` and
    ``grad_w[edges] += <grad_rows[dst], x[src]>`` (each only when given)."""
    gout = _to(grad_rows.contiguous(), device)  # a no-op when streamed there already
    held = _hold(account, gout)
    if grad_x is not None:
        _source_grads(c, gout, weight, grad_x, device, account)
    if grad_w is not None:
        assert x is not None, "edge-weight gradients need the source rows"
        _weight_grads(c, gout, x, grad_w, device, account)
    _release(account, held)


def _hold(account: MemoryAccount | None, *tensors: Tensor | None) -> int:
    return account.hold(*(t for t in tensors if t is not None)) if account else 0


def _release(account: MemoryAccount | None, nbytes: int) -> None:
    if account:
        account.release(nbytes)


def _source_grads(c: Chunk, gout: Tensor, weight: Tensor | None, grad_x: Tensor,
                  device: torch.device, account: MemoryAccount | None) -> None:
    """grad_x[src] += A_k^T gout through the chunk's transposed CSR."""
    t = c.graph.transpose()
    tg = c.graph_on(device, transposed=True)
    w_t = None if weight is None else _to(c.take_edges(weight.detach())[t.perm],
                                          device)
    held = _hold(account, tg.indptr, tg.indices, w_t)
    part = aggregate(tg, gout, w_t, "sum")
    held += _hold(account, part)
    grad_x.index_add_(0, c.src.to(grad_x.device), part.to(grad_x.device))
    _release(account, held)


def _weight_grads(c: Chunk, gout: Tensor, x: Tensor, grad_w: Tensor, device: torch.device,
                  account: MemoryAccount | None) -> None:
    """grad_w[e] = <gout[dst_e], x[src_e]> for the chunk's edges (SDDMM)."""
    g = c.graph_on(device)
    xs = _gather(x.detach(), c.src, device)
    held = _hold(account, g.indptr, g.indices, xs)
    part = edge_dot(g, gout, xs)[:, 0]
    held += _hold(account, part)
    c.add_edges(grad_w, part.to(grad_w.device))
    _release(account, held)
