"""The P2P (G3) executor's backward: phases and bins in reverse, gradients pushed back.

Each bin's stages are differentiated on their own (``torch.autograd.grad`` on the
graph the forward kept in ``Saved``). The gradient of a remote row read by the bin
is added into the phase's halo gradient, which goes back to the row's owner in the
round of the last bin that reads it (``comm.halo.start_return`` on the round's
table); the owner adds what arrives into its output gradient before the bins that
need it run (``Arrivals``). Same sums as the single-process executor, only in
another order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fullgraph.comm.halo import start_return
from fullgraph.models.stages import StageProgram
from fullgraph.parallel.p2p_plan import BinBlock, Key, P2PPlan, Phase, add_at, pos_len, whole
from fullgraph.parallel.p2p_run import Arrivals, Saved


@dataclass
class PhaseGrads:
    """The gradient buffers of one phase's backward.

    Attributes:
        out: w.r.t. the phase's output rows (pushed gradients added as they land).
        prev: w.r.t. the previous phase's rows (None: nothing earlier is trained, or
            not made yet when ``adopt``).
        halo: w.r.t. the halo rows, returned to their owners (None: not needed).
        carried: w.r.t. the values carried between phases, shared by all phases.
        wants_prev: whether the previous phase's rows need a gradient.
        wants_halo: whether the halo rows need one (the phase has a link).
        adopt: the phase is one bin that reads every previous row and every halo row
            in order: the gradient of its input rows, a fresh tensor, becomes ``prev``
            and ``halo`` as they are (no zeroed buffers, no adds).
    """

    out: Tensor
    prev: Tensor | None
    halo: Tensor | None
    carried: dict[Key, Tensor]
    wants_prev: bool = False
    wants_halo: bool = False
    adopt: bool = False


class ParamGrads:
    """This worker's parameter gradients, summed over bins."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.values = [torch.zeros_like(p) for p in params]
        self._where = {id(p): i for i, p in enumerate(params)}

    def of_phase(self, ph: Phase, model: StageProgram) -> list[torch.nn.Parameter]:
        """The parameters of the phase's stages."""
        return [p for p in self.params if any(
            p is q for s in range(ph.start, ph.stop) for q in model.stages[s].parameters())]

    def add(self, p: Tensor, g: Tensor) -> None:
        self.values[self._where[id(p)]] += g


def _bin_outputs(blk: BinBlock, entry: dict[str, Any],
                 grads: PhaseGrads) -> tuple[list[Tensor], list[Tensor]]:
    """The bin's differentiable outputs and their incoming gradients (a value that
    is both output and carried gets the sum)."""
    outs: list[Tensor] = []
    outs_grad: list[Tensor] = []

    def add_output(value: Tensor, grad: Tensor) -> None:
        if not value.requires_grad:
            return
        for i, o in enumerate(outs):
            if o is value:
                outs_grad[i] = outs_grad[i] + grad
                return
        outs.append(value)
        outs_grad.append(grad)

    add_output(entry["out"], grads.out[blk.rows])
    for key, value in entry["exports"].items():
        add_output(value, grads.carried[key][blk.index(key)])
    return outs, outs_grad


def _add_input_grad(blk: BinBlock, g_leaf: Tensor | None, grads: PhaseGrads) -> None:
    """Scatter the gradient of the bin's input rows: local ones and halo ones."""
    if g_leaf is None:
        return
    assert blk.src_local is not None and blk.src_halo is not None
    n_local = pos_len(blk.src_local)
    if grads.adopt:  # the buffers are the leaf's gradient, which the caller adds into
        held = [grads.out, *grads.carried.values()]  # a gradient passed through as it was
        own = g_leaf.clone() if any(_shares_storage(g_leaf, t) for t in held) else g_leaf
        grads.prev = own[:n_local]
        grads.halo = own[n_local:] if grads.wants_halo else None
        return
    assert grads.prev is not None
    add_at(grads.prev, blk.src_local, g_leaf[:n_local])
    if grads.halo is not None and pos_len(blk.src_halo):
        add_at(grads.halo, blk.src_halo, g_leaf[n_local:])


def bin_backward(blk: BinBlock, entry: dict[str, Any], grads: PhaseGrads,
                 own: list[torch.nn.Parameter], params: ParamGrads) -> None:
    """Differentiate one bin's stages and add every gradient where it belongs."""
    outs, outs_grad = _bin_outputs(blk, entry, grads)
    if not outs:
        return
    with_input = grads.wants_prev
    import_keys = list(entry["imports"])
    inputs = ([entry["leaf"]] if with_input else []) + [entry["imports"][k] for k in import_keys]
    result = torch.autograd.grad(outs, inputs + own, outs_grad, allow_unused=True)
    pos = 0
    if with_input:
        _add_input_grad(blk, result[0], grads)
        pos = 1
    for key in import_keys:
        g = result[pos]
        pos += 1
        if g is not None:
            add_at(grads.carried[key], blk.index(key), g)
    for p, g in zip(own, result[pos:]):
        if g is not None:
            params.add(p, g)


class Backward:
    """The backward over phases and bins, from what the forward saved."""

    def __init__(self, model: StageProgram, plan: P2PPlan, saved: Saved,
                 params: list[torch.nn.Parameter]) -> None:
        self.model, self.plan, self.saved, self.mode = model, plan, saved, plan.mode
        self.params = ParamGrads(params)

    def run(self, grad_logits: Tensor) -> list[Tensor]:
        """Parameter gradients (this worker's share) from the output rows' gradient."""
        g_out = grad_logits
        carried = self.saved.carried.zero_grads()
        pending: list[Any] = []
        for k in range(len(self.plan.phases) - 1, -1, -1):
            if not self.plan.phases[k].needs_grad:
                break  # nothing earlier has parameters: no gradient to return
            g_prev, pending = self._phase(k, g_out, carried, pending)
            if g_prev is None:
                break  # the phase before has no trained parameter upstream
            g_out = g_prev
        return self.params.values

    def _buffers(self, k: int, g_out: Tensor, carried: dict[Key, Tensor]) -> PhaseGrads:
        ph, outputs = self.plan.phases[k], self.saved.outputs
        prev_needs = k > 0 and self.plan.phases[k - 1].needs_grad
        num_halo = 0 if ph.link is None else ph.link.num_halo
        adopt = prev_needs and len(ph.bins) == 1 and _reads_all(ph.bins[0], outputs[k - 1],
                                                                 num_halo)
        grads = PhaseGrads(g_out, None, None, carried, wants_prev=prev_needs,
                           wants_halo=prev_needs and ph.link is not None, adopt=adopt)
        if prev_needs and not adopt:
            grads.prev, grads.halo = self._zeros(k, grads.wants_halo)
        return grads

    def _zeros(self, k: int, halo: bool) -> tuple[Tensor, Tensor | None]:
        """Zeroed gradient buffers of the previous phase's rows and of the halo."""
        prev = self.saved.outputs[k - 1]
        link = self.plan.phases[k].link
        return (prev.new_zeros(prev.shape),
                prev.new_zeros(link.num_halo, prev.shape[1]) if halo and link else None)

    def _phase(self, k: int, g_out: Tensor, carried: dict[Key, Tensor],
               pending: list[Any]) -> tuple[Tensor | None, list[Any]]:
        """Phase k's bins in backward order; returns the previous phase's output
        gradient and the gradient pushes issued."""
        plan, mode = self.plan, self.mode
        ph = plan.phases[k]
        incoming = None
        if k + 1 < len(plan.phases):
            incoming = Arrivals(pending, g_out)
            if not mode.eager:
                incoming.all()
        grads = self._buffers(k, g_out, carried)
        issued: list[Any] = []
        entries = self.saved.entries[k]
        own = self.params.of_phase(ph, self.model)
        for t, b in enumerate(ph.bwd_order):
            if incoming is not None and mode.eager:
                incoming.through(ph.bwd_wait[b])
            bin_backward(ph.bins[b], entries[b], grads, own, self.params)
            if grads.adopt and grads.prev is None:  # no gradient reached the input rows
                grads.prev, grads.halo = self._zeros(k, grads.wants_halo)
            if grads.halo is not None and mode.per_bin:
                assert ph.link is not None
                issued.append(start_return(grads.halo, ph.link.bwd[t], plan.comm, "push-grad"))
        if grads.halo is not None:
            assert ph.link is not None
            for j in range(len(issued), len(ph.link.bwd)):
                issued.append(start_return(grads.halo, ph.link.bwd[j], plan.comm, "push-grad"))
        if incoming is not None:
            incoming.all()
        return grads.prev, issued


def _reads_all(blk: BinBlock, prev: Tensor, num_halo: int) -> bool:
    """Whether the bin reads every row of ``prev`` and every halo row, in order."""
    return (blk.src_local is not None and blk.src_halo is not None
            and whole(blk.src_local, prev.shape[0]) and whole(blk.src_halo, num_halo))


def _shares_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
