"""Which rows each stage of a program computes on one worker of a row partition.

Data parallelism (NeutronCloud §2.3, Algorithm 1) gives worker i the rows V_i. A P
or E stage needs, besides rows it computes itself, the rows of its remote
in-neighbours. For each remote vertex the worker either fetches the row from its
owner at that stage (DepComm) or computes it locally from replicated inputs
(DepCache), recursively through earlier stages. This module turns a per-vertex
choice into per-stage row sets, walking the program backwards from the rows the
loss needs, and builds the local CSR blocks (``graph.blocks``) the P / E stages
run on.

Rules, for worker i and stage s:
- ``rows[s]``: the rows stage s outputs, always V_i first (in partition-book order)
  then the extra rows computed for DepCache in ascending gid order.
- a P / E stage needs the in-neighbours of its destination rows; those marked
  ``fetch`` are fetched from their owner (``fetched[s]``), all others are computed
  by the previous stage on this worker;
- a vertex is marked ``fetch`` iff it is a remote in-neighbour of V_i (a direct
  dependency) and the dependency plan does not cache it; vertices reached only
  through cached ones are computed locally (the L-hop cache of DepCache).

``stage_weights`` gives every P stage its fixed edge weights on its block's edges.

Pure functions of (graph, program, book, choice): tested without processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from fullgraph.graph.blocks import Block, build_block, in_edges
from fullgraph.graph.csr import Graph
from fullgraph.models.stages import StageProgram
from fullgraph.models.walk import describe


@dataclass
class RowPlan:
    """Per-stage row sets of one worker.

    Attributes:
        owned: (|V_i|,) gids of this worker's vertices (partition-book order).
        input_rows: gids of the feature rows the first stage reads.
        rows: per stage, gids of its output rows (for E stages: its destination rows).
        in_pos: per stage, positions of the rows a T stage reads in its input rows
            (None when identical).
        layer_pos: per T stage reading the layer input, positions of its rows in the
            layer input's rows (None when identical or unused).
        fetched: per P / E stage, gids fetched from owners (ascending; empty else).
        blocks: per P / E stage, its Block (None for T stages).
        shares_halo: per stage, True when a P stage reuses the rows fetched for the
            E stage just before it (same input tensor).
    """

    owned: Tensor
    input_rows: Tensor
    rows: list[Tensor]
    in_pos: list[Tensor | None]
    layer_pos: list[Tensor | None]
    fetched: list[Tensor]
    blocks: list[Block | None]
    shares_halo: list[bool] = field(default_factory=list)

    def block(self, s: int) -> Block:
        """Stage ``s``'s block (``s`` must be a P or E stage)."""
        block = self.blocks[s]
        assert block is not None, f"stage {s} is a T stage: it has no block"
        return block

    def edges_computed(self) -> tuple[int, int]:
        """(local, redundant) edges over all P stages: destination owned or not."""
        num_owned = self.owned.numel()
        local = redundant = 0
        for block in self.blocks:
            if block is None:
                continue
            deg = block.graph.in_degrees()
            local += int(deg[:num_owned].sum())
            redundant += int(deg[num_owned:].sum())
        return local, redundant


def _ordered(owned: np.ndarray, owned_mask: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """V_i first, then the extra (non-owned) gids ascending, unique."""
    extra = np.unique(extra[~owned_mask[extra]]) if extra.size else extra
    return np.concatenate([owned, extra]).astype(np.int64)


def _positions(rows: np.ndarray, within: np.ndarray, scratch: np.ndarray) -> Tensor | None:
    """Positions of ``rows`` in ``within`` (None when they are equal)."""
    if rows.size == within.size and np.array_equal(rows, within):
        return None
    scratch[within] = np.arange(within.size)
    return torch.from_numpy(scratch[rows].copy())


def plan_rows(program: StageProgram, graph: Graph, owned: Tensor, fetch: Tensor,
              owner: Tensor | None = None, *, local_first: bool = False) -> RowPlan:
    """Row sets of every stage for the worker owning ``owned``.

    Args:
        program: the stage program.
        graph: the global propagation graph (self-loops as the program wants).
        owned: (|V_i|,) gids of this worker's vertices, in partition-book order.
        fetch: (N,) bool, True for the vertices fetched from their owner when needed
            (direct remote dependencies under DepComm); every other row is computed
            locally.
        owner: (N,) part of each vertex; fetched rows are then ordered by (owner, gid),
            the order in which a halo exchange delivers them (default: by gid).
        local_first: the P and E blocks list each row's in-edges from local rows
            before those from fetched rows (``graph.blocks.build_block``), so that a
            kernel can read the two from two buffers (default: False, CSR order).

    Returns:
        The RowPlan.
    """
    n = graph.num_dst
    owned_np = owned.numpy().astype(np.int64)
    owned_mask = np.zeros(n, dtype=bool)
    owned_mask[owned_np] = True
    fetch_np = fetch.numpy() & ~owned_mask
    infos = describe(program)
    num = len(infos)
    rows: list[np.ndarray] = [owned_np] * num
    fetched: list[np.ndarray] = [np.empty(0, np.int64)] * num
    layer_need: dict[int, np.ndarray] = {}  # LayerInput stage -> rows later stages read
    edge_dst: dict[int, np.ndarray] = {}  # E stage index -> destination rows its P's need
    need = owned_np
    for s in range(num - 1, -1, -1):
        info = infos[s]
        if info.is_transform:
            extra = [need]
            if info.opens_layer:
                extra.append(layer_need.pop(s, np.empty(0, np.int64)))
            rows[s] = _ordered(owned_np, owned_mask, np.concatenate(extra))
            li = info.layer_input_from
            if li is not None:
                layer_need[li] = np.concatenate([layer_need.get(li, rows[s][:0]), rows[s]])
            need = rows[s]
            continue
        if info.is_propagate:
            dst = _ordered(owned_np, owned_mask, need)
            e = info.edge_weights_from
            if e is not None:
                edge_dst[e] = np.concatenate([edge_dst.get(e, dst[:0]), dst])
        else:  # E stage: destinations are those of the P stages using its weights
            dst = _ordered(owned_np, owned_mask, edge_dst.pop(s, need))
        rows[s] = dst
        fetched[s], local = _split_sources(graph, dst, fetch_np, owner)
        if info.is_edge:  # the E stage reads its destinations' own rows
            local = np.concatenate([local, dst])
        need = _ordered(owned_np, owned_mask, local)
    return _assemble(program, graph, owned_np, need, rows, fetched, local_first)


def _split_sources(graph: Graph, dst: np.ndarray, fetch: np.ndarray,
                   owner: Tensor | None) -> tuple[np.ndarray, np.ndarray]:
    """The in-neighbours of ``dst``: (fetched ones, in (owner, gid) order when ``owner``
    is given; the ones computed locally)."""
    _, src, _ = in_edges(graph, dst)
    src = np.unique(src)
    got = src[fetch[src]]
    if owner is not None and got.size:
        got = got[np.lexsort((got, owner.numpy()[got]))]
    return got, src[~fetch[src]]


def _assemble(program: StageProgram, graph: Graph, owned: np.ndarray, input_rows: np.ndarray,
              rows: list[np.ndarray], fetched: list[np.ndarray],
              local_first: bool = False) -> RowPlan:
    """Positions, blocks and halo sharing from the row sets."""
    n = graph.num_dst
    scratch = np.zeros(n, dtype=np.int64)
    infos = describe(program)
    in_pos: list[Tensor | None] = []
    layer_pos: list[Tensor | None] = []
    blocks: list[Block | None] = []
    shares: list[bool] = []
    cur = input_rows
    for s, info in enumerate(infos):
        if info.is_transform:
            in_pos.append(_positions(rows[s], cur, scratch))
            li = info.layer_input_from
            layer_pos.append(None if li is None else _positions(rows[s], rows[li], scratch))
            blocks.append(None)
            shares.append(False)
            cur = rows[s]
            continue
        in_pos.append(None)
        layer_pos.append(None)
        blocks.append(build_block(graph, rows[s], cur, fetched[s], scratch,
                                  local_first=local_first))
        shares.append(info.is_propagate and s > 0 and infos[s - 1].is_edge
                      and np.array_equal(fetched[s], fetched[s - 1]))
        if info.is_propagate:
            cur = rows[s]
    as_t = [torch.from_numpy(r) for r in rows]
    return RowPlan(torch.from_numpy(owned), torch.from_numpy(input_rows), as_t, in_pos,
                   layer_pos, [torch.from_numpy(f) for f in fetched], blocks, shares)


def stage_weights(program: StageProgram, rows: RowPlan, norms: dict[str, Tensor],
                  device: torch.device) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """Per P stage, its fixed edge weights on the block's edges; for ``norm='edge'``
    stages, the positions of the block's edges in the last E stage's block (None when
    they are the same edges in the same order)."""
    weights: list[Tensor | None] = []
    edge_pos: list[Tensor | None] = []
    for s, info in enumerate(describe(program)):
        if not info.is_propagate:
            weights.append(None)
            edge_pos.append(None)
        elif info.edge_weights_from is not None:
            weights.append(None)
            edge_pos.append(_positions_in(rows.block(s).eids,
                                          rows.block(info.edge_weights_from).eids))
        else:
            norm = norms[program.propagate_stage(s).norm]
            weights.append(norm[rows.block(s).eids.cpu()].to(device))
            edge_pos.append(None)
    return weights, edge_pos


def _positions_in(eids: Tensor, within: Tensor | None) -> Tensor | None:
    if within is None:
        raise ValueError("a P stage with norm='edge' has no E stage before it")
    if eids.numel() == within.numel() and torch.equal(eids, within):
        return None
    order = torch.argsort(within)
    return order[torch.searchsorted(within[order], eids)]
