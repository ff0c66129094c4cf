"""The P2P (G3) executor's forward over phases and bins, and the pieces it shares.

``Forward`` walks the phases (``p2p_plan.Phase``) in order and their bins in
schedule order; each bin's output rows are pushed to the peers that read them
(``comm.halo.start_fetch`` on the round's table), and a bin waits only for the
rounds it reads (``Arrivals``, also used by the backward in ``p2p_backward``).
Values one phase carries to a later one (layer inputs, edge weights) live in
``Carried``; ``Saved`` is what the backward needs; ``_Loader`` prefetches the next
bin's inputs.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from fullgraph.comm.halo import start_fetch
from fullgraph.models.stages import StageContext, StageProgram
from fullgraph.models.walk import Carry, Runner, walk
from fullgraph.ops.sparse import densify, take_rows
from fullgraph.parallel.p2p_plan import BinBlock, Key, P2PPlan, Phase, pos_len, take, whole


class _Pending(Protocol):
    def wait(self, into: Tensor) -> Tensor: ...


class Arrivals:
    """The rounds pushed into a buffer: waited for in order, each placed as it lands."""

    def __init__(self, pending: list[_Pending], target: Tensor) -> None:
        self.pending, self.target = pending, target
        self.done = 0

    def through(self, last: int) -> None:
        """Make rounds 0..last (inclusive) present in the target."""
        while self.done <= min(last, len(self.pending) - 1):
            self.pending[self.done].wait(self.target)
            self.done += 1

    def all(self) -> None:
        self.through(len(self.pending) - 1)


class _Loader:
    """Loads a bin's input rows, the next one ahead of time when prefetching."""

    def __init__(self, prefetch: bool, device: torch.device) -> None:
        self.prefetch, self.device = prefetch, device
        self.stream = torch.cuda.Stream(device) if prefetch and device.type == "cuda" else None
        self.pool = ThreadPoolExecutor(1) if prefetch and self.stream is None else None
        self.ahead: tuple[int, Any] | None = None

    def start(self, key: int, fn: Any) -> None:
        """Begin loading ``fn()`` for bin ``key`` in the background (when prefetching)."""
        if self.stream is not None:
            event = torch.cuda.Event()
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                value = fn()
                event.record(self.stream)
            self.ahead = (key, (value, event))
        elif self.pool is not None:
            self.ahead = (key, self.pool.submit(fn))

    def get(self, key: int, fn: Any) -> Any:
        """Bin ``key``'s inputs: the prefetched ones if they were started, else ``fn()``."""
        if self.ahead is None or self.ahead[0] != key:
            return fn()
        _, handle = self.ahead
        self.ahead = None
        if self.stream is not None:
            value, event = handle
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            # a bin's rows are one tensor (CSR for sparse features): mark its storage,
            # not each of its rows (iterating a tensor yields row views, one per row)
            parts = (value.crow_indices(), value.col_indices(), value.values()) \
                if value.layout == torch.sparse_csr else (value,)
            for t in parts:
                t.record_stream(stream)
            return value
        return handle.result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class Carried:
    """Values of one phase that later phases import, over all rows or edges."""

    def __init__(self, plan: P2PPlan) -> None:
        self.plan = plan
        self.buffers: dict[Key, Tensor] = {}

    def store(self, key: Key, blk: BinBlock, value: Tensor) -> None:
        # sparse input features read again by a later phase (GraphSAGE's root weight
        # after its first propagation) are carried dense: buffers are written by rows
        value = densify(value)
        buf = self.buffers.get(key)
        if buf is None:
            total = self.plan.rows.owned.numel() if key[0] == "rows" else \
                self.plan.rows.block(key[1]).graph.num_edges
            buf = value.new_zeros((total, *value.shape[1:]))
            self.buffers[key] = buf
        buf[blk.index(key)] = value

    def read(self, key: Key, blk: BinBlock) -> Tensor:
        return self.buffers[key][blk.index(key)]

    def zero_grads(self) -> dict[Key, Tensor]:
        """A zero gradient buffer per carried value."""
        return {key: torch.zeros_like(buf) for key, buf in self.buffers.items()}


@dataclass
class Saved:
    """What the forward keeps for the backward.

    Attributes:
        entries: per phase, per bin (phases that need a gradient only), the bin's
            input leaf, imports, output and exports with their autograd graph.
        outputs: per phase, its output rows.
        carried: the values carried between phases.
    """

    carried: Carried
    entries: list[list[dict[str, Any]]] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)


class _BinRunner(Runner):
    """Stage hooks over one bin: its rows, its CSR (sources local then pushed) and
    the edge weights of its edges."""

    passes_rows_through = True

    def __init__(self, blk: BinBlock, weights: list[Tensor | None], seed: int,
                 training: bool) -> None:
        self.blk, self.weights = blk, weights
        self.ctx = StageContext(blk.gids, seed, training)
        self.edge_ctx = StageContext(blk.gids, seed, training, blk.eids)
        self.on_sources = blk.src_local is not None  # h: the bin's sources, not its rows

    def transform(self, s: int, stage: Any, h: Tensor, layer_input: Tensor | None) -> Tensor:
        if self.on_sources:  # a T stage after the phase's E stage (E T P): the E stage
            # read the sources; a T stage reads the bin's own rows among them
            assert self.blk.dst_pos is not None, "a phase that opens with an E stage"
            h, self.on_sources = take(h, self.blk.dst_pos), False
        return stage(h, self.ctx, layer_input)

    def edge(self, s: int, stage: Any, h: Tensor) -> Tensor:
        return stage(self.blk.graph, h[self.blk.dst_pos], h, self.edge_ctx)

    def propagate(self, s: int, stage: Any, h: Tensor, edge_weights: Tensor | None) -> Tensor:
        if edge_weights is None:
            weight = self.weights[s]
            assert weight is not None
            edge_weights = self.blk.edge_weights(s, weight)
        self.on_sources = False
        return stage(self.blk.graph, h, edge_weights)


def _load(blk: BinBlock, h_prev: Tensor, halo: Tensor | None,
          joined: Tensor | None = None) -> Tensor:
    """A bin's input rows: its own rows (phase 0), else its local then pushed sources.

    ``joined``: one buffer holding ``h_prev`` then ``halo`` (``Forward`` allocates the
    previous phase's output so); a bin that reads every row of both reads it as is.
    """
    if blk.src_local is None:  # the input features: CSR when sparse
        if whole(blk.rows, h_prev.shape[0]):
            return h_prev
        rows = blk.rows
        return take_rows(h_prev, rows if isinstance(rows, Tensor) else
                         torch.arange(rows.start, rows.stop))
    assert blk.src_halo is not None
    num_halo = 0 if halo is None else halo.shape[0]
    if joined is not None and whole(blk.src_local, h_prev.shape[0]) and \
            whole(blk.src_halo, num_halo):
        return joined
    parts = [take(h_prev, blk.src_local)]
    if pos_len(blk.src_halo):
        assert halo is not None, "a bin reads pushed rows: the phase has a halo"
        parts.append(take(halo, blk.src_halo))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class Forward:
    """The forward over phases and bins; fills a ``Saved`` for the backward."""

    def __init__(self, model: StageProgram, plan: P2PPlan, seed: int, training: bool) -> None:
        self.model, self.plan, self.seed, self.training = model, plan, seed, training
        self.mode = plan.mode
        self.saved = Saved(Carried(plan))
        # the last phase's output rows followed by room for the next phase's halo
        self._joined: Tensor | None = None

    def run(self, keep: bool) -> Tensor:
        h_prev = self.plan.features
        pending: list[Any] = []
        loader = _Loader(self.mode.prefetch, self.plan.device)
        try:
            for k in range(len(self.plan.phases)):
                h_prev, pending = self._phase(k, h_prev, pending, loader, keep)
        finally:
            loader.close()
        return h_prev

    def _phase(self, k: int, h_prev: Tensor, pending: list[Any], loader: _Loader,
               keep: bool) -> tuple[Tensor, list[Any]]:
        """Run phase k's bins; returns its output and the pushes it issued."""
        plan, mode = self.plan, self.mode
        ph = plan.phases[k]
        halo = incoming = None
        joined, self._joined = self._joined, None
        if ph.link is not None:
            if joined is not None:
                halo = joined[h_prev.shape[0]:]
            else:
                halo = h_prev.new_empty(ph.link.num_halo, h_prev.shape[1])
            incoming = Arrivals(pending, halo)
            if not mode.eager:
                incoming.all()
        nxt = plan.phases[k + 1].link if k + 1 < len(plan.phases) else None
        # h_prev: maybe CSR; with a next phase, its halo lands right after the rows
        rows = h_prev.shape[0]
        out = torch.empty(rows + (0 if nxt is None else nxt.num_halo), ph.out_dim,
                          dtype=h_prev.dtype, device=h_prev.device)
        halo_next = None  # where the pushes for the next phase land here
        if nxt is not None:
            self._joined, out, halo_next = out, out[:rows], out[rows:]
        issued: list[Any] = []
        saved: list[dict[str, Any]] = []
        grad_in = keep and k > 0 and plan.phases[k - 1].needs_grad
        for b, blk in enumerate(ph.bins):
            if incoming is not None and mode.eager:
                incoming.through(ph.fwd_wait[b])
            x = loader.get(b, lambda blk=blk, h=h_prev, hl=halo, j=joined: _load(blk, h, hl, j))
            if incoming is not None and incoming.done < len(incoming.pending) and \
                    joined is not None and x.untyped_storage().data_ptr() == \
                    joined.untyped_storage().data_ptr():
                # a view of the buffer later rounds land in (eager schedules): what the
                # stages save of it must not change under them
                x = x.clone()
            self._prefetch(loader, ph, b + 1, incoming, h_prev, halo, joined)
            entry = self._compute(ph, blk, x, keep and ph.needs_grad, grad_in)
            self._keep(out, blk, entry, saved if keep and ph.needs_grad else None)
            if nxt is not None and mode.per_bin:
                issued.append(start_fetch(out, nxt.fwd[b], plan.comm, "push", halo_next))
        if nxt is not None:  # rounds past my last bin (all of them if sequential)
            for j in range(len(issued), len(nxt.fwd)):
                issued.append(start_fetch(out, nxt.fwd[j], plan.comm, "push", halo_next))
        if incoming is not None:
            incoming.all()  # rounds that carried nothing for this worker
        self.saved.entries.append(saved)
        self.saved.outputs.append(out)
        return out, issued

    def _keep(self, out: Tensor, blk: BinBlock, entry: dict[str, Any],
              saved: list[dict[str, Any]] | None) -> None:
        """Write a bin's output rows and carried values; keep its graph if asked."""
        out[blk.rows] = entry["out"].detach()
        for key, value in entry["exports"].items():
            self.saved.carried.store(key, blk, value.detach())
        if saved is not None:
            saved.append(entry)

    def _prefetch(self, loader: _Loader, ph: Phase, b: int, incoming: Arrivals | None,
                  h_prev: Tensor, halo: Tensor | None, joined: Tensor | None) -> None:
        """Start loading bin ``b`` if its pushed rows are already here."""
        if not loader.prefetch or b >= len(ph.bins):
            return
        if incoming is not None and ph.fwd_wait[b] >= incoming.done:
            return  # it reads rows not received yet: loaded when its turn comes
        blk = ph.bins[b]
        loader.start(b, lambda: _load(blk, h_prev, halo, joined))

    def _compute(self, ph: Phase, blk: BinBlock, x: Tensor, keep: bool,
                 grad_in: bool) -> dict[str, Any]:
        """Run the phase's stages on one bin; with ``keep`` the autograd graph is kept
        (``grad_in``: also towards the input rows)."""
        with torch.set_grad_enabled(keep):
            leaf = x.detach().requires_grad_(keep and grad_in)
            imports = {key: self.saved.carried.read(key, blk).detach().requires_grad_(keep)
                       for key in ph.imports}
            carry = Carry({s: v for (kind, s), v in imports.items() if kind == "rows"},
                          {s: v for (kind, s), v in imports.items() if kind == "edges"})
            runner = _BinRunner(blk, self.plan.weights, self.seed, self.training)
            out = walk(self.model, runner, leaf, start=ph.start, stop=ph.stop, carry=carry)
            exports = {key: (carry.layer_inputs if key[0] == "rows" else
                             carry.edge_weights)[key[1]] for key in ph.exports}
        return {"leaf": leaf, "imports": imports, "out": out, "exports": exports}
