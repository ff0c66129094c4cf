"""Stage types and the StageProgram: a GNN written once as a list of T / E / P stages.

- ``Transform`` (T): a vertex-wise neural network. Row r of its output depends only on
  row r of its input (and of the layer input), so it runs on any set of whole rows;
  a stage that also reads column statistics over all vertices (batch normalisation)
  gets them through ``StageContext.sum_rows``, which each executor supplies.
- ``EdgeTransform`` (E): edge weights from both endpoints' rows (GAT attention). It
  runs on a block holding every in-edge of its destinations.
- ``Propagate`` (P): a weighted sum over in-edges; linear and parameter-free, so it
  runs on any column slice or on a row block plus its remote in-neighbours.

Every executor in ``fullgraph.parallel`` runs the same program; ``StageProgram.forward``
is the reference semantics that the single-process executor uses and every other
executor must reproduce. Each layer starts with a ``LayerInput`` stage whose output
(the layer input, after dropout) later T stages of the layer may read, e.g. for
GraphSAGE's root weight, GIN's self term or a residual connection.

This module must not import ``fullgraph.comm`` or ``fullgraph.parallel``.

Shapes: R rows, N_dst / N_src vertices of a block, E edges, D columns, H heads.
"""
from __future__ import annotations

import contextvars
import enum
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable, ClassVar, overload

import torch
from torch import Tensor, nn

from fullgraph.graph.csr import Graph
from fullgraph.ops import keyed_dropout, spmm
from fullgraph.ops.sparse import is_sparse, sparse_dropout


class StageKind(str, enum.Enum):
    """The three stage kinds (docs/architecture.md): transform, edge, propagate."""

    TRANSFORM = "T"
    EDGE = "E"
    PROPAGATE = "P"


@dataclass
class StageContext:
    """What a stage needs to know about the rows it runs on.

    Attributes:
        gids: (R,) int64 global vertex ids of the rows (keys for keyed dropout).
        seed: the step seed; with ``gids`` it fixes every dropout mask.
        training: whether dropout is active.
        eids: (E,) int64 global edge ids of the block's edges (attention dropout).
        row_sum: the executor's column sum over every vertex of the graph, each
            counted once, of a stage's (R, D) rows: differentiable, the same (D,)
            result on every worker (an all-reduce where rows are spread over
            workers). None: the rows are every vertex once, summed locally.
    """

    gids: Tensor
    seed: int
    training: bool
    eids: Tensor | None = None
    row_sum: Callable[[Tensor], Tensor] | None = None

    def rows(self, gids: Tensor) -> "StageContext":
        """The same context for another set of rows."""
        return StageContext(gids, self.seed, self.training, self.eids, self.row_sum)

    def sum_rows(self, x: Tensor) -> Tensor:
        """(D,) column sums of ``x`` over all vertices (see ``row_sum``); only for a
        stage that declares ``reduces_rows`` (an executor that splits rows sums over
        all of them only for such a stage: p2p's bins and row blocks would sum over
        their own rows)."""
        undeclared = UNDECLARED_SUM.get()
        if undeclared is not None:
            from fullgraph.errors import ConfigError  # (the model's mistake: one line)

            raise ConfigError(f"stage {undeclared} calls ctx.sum_rows without declaring "
                             "reduces_rows = True, which every strategy needs to sum over "
                             "all vertices (README, 'Your own model')")
        return x.sum(0) if self.row_sum is None else self.row_sum(x)


UNDECLARED_SUM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "UNDECLARED_SUM", default=None)
"""Set by the walker around a T stage that does not declare ``reduces_rows`` (its
index and class, for the message): ``StageContext.sum_rows`` refuses it."""


def check_probability(p: float, name: str) -> float:
    """``p`` as a float if it is a valid dropout probability, else ValueError."""
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}")
    return float(p)


def stage_seed(seed: int, index: int) -> int:
    """Seed of stage ``index`` within a step: distinct per stage, stable across executors."""
    return (int(seed) * 1_000_003 + 7919 * (index + 1)) & 0xFFFFFFFF


class Stage(nn.Module):
    """Common base: every stage knows its kind, its index in the program and its
    widths (an E stage's are those of the rows it reads, which it leaves as they are;
    its weights' columns are its ``heads``)."""

    kind: ClassVar[StageKind]
    index: int = -1
    in_dim: int
    out_dim: int

    def extra_repr(self) -> str:
        return f"index={self.index}"


class Transform(Stage):
    """T stage: ``forward(x_rows, ctx, layer_input) -> y_rows``, row by row.

    Attributes:
        in_dim, out_dim: input and output columns.
        uses_layer_input: the stage reads the layer input (must be given the same rows).
        reduces_rows: the stage also reads statistics over all rows (``ctx.sum_rows``,
            e.g. batch normalisation), so its executor must supply ``ctx.row_sum``.
        reads_sparse: the stage takes CSR rows (sparse input features) as its input
            and layer input.
    """

    kind = StageKind.TRANSFORM
    uses_layer_input: bool = False
    reduces_rows: bool = False
    reads_sparse: bool = False  # takes CSR rows (sparse input features)

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim

    def forward(self, x: Tensor, ctx: StageContext, layer_input: Tensor | None = None) -> Tensor:
        raise NotImplementedError


class LayerInput(Transform):
    """First stage of every layer: dropout of the layer's input rows, keyed by vertex id.

    Its output is the layer input that later T stages of the layer may read.
    """

    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__(dim, dim)
        self.p = check_probability(dropout, "dropout")

    def forward(self, x: Tensor, ctx: StageContext, layer_input: Tensor | None = None) -> Tensor:
        if is_sparse(x):  # sparse input features: the stored entries only, same mask
            if not ctx.training or self.p == 0.0:
                return x
            return sparse_dropout(x, self.p, ctx.gids, stage_seed(ctx.seed, self.index))
        return keyed_dropout(x, self.p, ctx.gids, stage_seed(ctx.seed, self.index), ctx.training)

    def extra_repr(self) -> str:
        return f"index={self.index}, dim={self.in_dim}, p={self.p}"


class EdgeTransform(Stage):
    """E stage: ``forward(graph, x_dst, x_src, ctx) -> (E, H)`` edge weights.

    ``graph`` holds every in-edge of its destinations; ``x_dst`` are the destination
    rows and ``x_src`` the source rows (the same tensor for a square graph).

    Attributes:
        in_dim, out_dim: the columns of the rows it reads (both: it leaves the rows
            as they are).
        heads: H, its weights' columns. A P stage with ``norm="edge"`` weights its
            D columns in H contiguous blocks of D / H, column block h by head h, so
            H must divide D.
    """

    kind = StageKind.EDGE
    heads: int = 1

    def __init__(self, in_dim: int | None = None, heads: int | None = None) -> None:
        super().__init__()
        if in_dim is not None:  # (a subclass may set them itself, as the README's do,
            self.in_dim = self.out_dim = int(in_dim)  # or ``heads`` on the class)
        if heads is not None:
            self.heads = int(heads)

    def forward(self, graph: Graph, x_dst: Tensor, x_src: Tensor, ctx: StageContext) -> Tensor:
        raise NotImplementedError


class Propagate(Stage):
    """P stage: weighted sum over in-edges with fixed (``gcn``, ``mean``, ``sum``) or
    attention (``edge``, from the last E stage) weights. Column-independent and linear.
    """

    kind = StageKind.PROPAGATE

    def __init__(self, dim: int, norm: str) -> None:
        super().__init__()
        if norm not in ("gcn", "mean", "sum", "edge"):
            raise ValueError(f"unknown propagation norm {norm!r}; expected gcn, mean, sum or edge")
        self.in_dim = self.out_dim = dim
        self.norm = norm

    def forward(self, graph: Graph, x_src: Tensor, weight: Tensor) -> Tensor:
        return spmm(graph, x_src, weight)

    def extra_repr(self) -> str:
        return f"index={self.index}, dim={self.in_dim}, norm={self.norm}"


class StageList(nn.ModuleList):
    """The stages of a program: an ``nn.ModuleList`` whose items are typed as stages."""

    @overload  # type: ignore[override]
    def __getitem__(self, idx: int) -> Stage: ...

    @overload
    def __getitem__(self, idx: slice) -> StageList: ...

    def __getitem__(self, idx: int | slice) -> Stage | StageList:
        return super().__getitem__(idx)  # type: ignore[return-value]

    def __iter__(self) -> Iterator[Stage]:
        return super().__iter__()  # type: ignore[return-value]


class StageProgram(nn.Module):
    """A GNN as an ordered list of stages, plus what its propagation graph must be.

    Args:
        stages: the stages in execution order.
        self_loops: whether the graph the P / E stages run on has one self-loop per
            vertex (True) or none (False).
        name: a short model name for reports.

    Attributes:
        layer_of: layer index of each stage (a layer starts at each ``LayerInput``).
    """

    def __init__(self, stages: list[Stage], *, self_loops: bool, name: str) -> None:
        if "_modules" not in self.__dict__:  # (a GNN sets the module up before its conv())
            super().__init__()
        self.stages = StageList(stages)
        self.self_loops = self_loops
        self.name = name
        self.layer_of: list[int] = []
        layer = -1
        for i, stage in enumerate(stages):
            stage.index = i
            layer += isinstance(stage, LayerInput)
            self.layer_of.append(max(layer, 0))
        self._check()

    @property
    def in_dim(self) -> int:
        return self.stages[0].in_dim

    @property
    def out_dim(self) -> int:
        last = [s for s in self.stages if not isinstance(s, EdgeTransform)][-1]
        return last.out_dim

    @property
    def norms(self) -> set[str]:
        """The fixed edge normalisations the P stages need (``edge`` excluded)."""
        return {s.norm for s in self.stages if isinstance(s, Propagate) and s.norm != "edge"}

    def propagate_stage(self, s: int) -> Propagate:
        """Stage ``s``, which must be a P stage."""
        stage = self.stages[s]
        assert isinstance(stage, Propagate), f"stage {s} is not a P stage"
        return stage

    @property
    def reduces_rows(self) -> bool:
        """Whether some T stage reads statistics over all rows (``ctx.row_sum``)."""
        return any(sums_over_rows(s) for s in self.stages)

    def signature(self) -> str:
        """The program as a string of stage kinds, e.g. ``"TTPT TTPT"``."""
        out = []
        for i, s in enumerate(self.stages):
            if i and isinstance(s, LayerInput):
                out.append(" ")
            out.append(s.kind.value)
        return "".join(out)

    def _check(self) -> None:
        if not self.stages or not isinstance(self.stages[0], LayerInput):
            raise ValueError("a stage program must start with a LayerInput stage")
        seen_edge: EdgeTransform | None = None
        width, before = self.stages[0].in_dim, "the input"
        for s in self.stages:
            if not isinstance(s, (Transform, EdgeTransform, Propagate)):
                raise ValueError(f"model {self.name}: stage {s.index} (layer "
                                 f"{self.layer_of[s.index] + 1}) is a {type(s).__name__}, "
                                 "not a Transform, EdgeTransform or Propagate (each stage "
                                 "is one of these kinds: README, 'Your own model')")
            _check_forward(s, self.name, self.layer_of[s.index])
            if isinstance(s, EdgeTransform):
                _check_edge_stage(s, self.name, self.layer_of[s.index], width)
                seen_edge = s
            if s.in_dim != width:
                raise ValueError(f"model {self.name}: stage {s.index} "
                                 f"({type(s).__name__}, layer {self.layer_of[s.index] + 1}) "
                                 f"takes {s.in_dim} columns but {before} gives {width}")
            if not isinstance(s, EdgeTransform):  # an E stage leaves the rows as they are
                width, before = s.out_dim, f"stage {s.index} ({type(s).__name__})"
            if isinstance(s, Propagate) and s.norm == "edge" and seen_edge is None:
                raise ValueError(f"stage {s.index}: norm='edge' needs an earlier EdgeTransform")
            if isinstance(s, Propagate) and s.norm == "edge" and seen_edge is not None \
                    and s.in_dim % seen_edge.heads:
                raise ValueError(
                    f"model {self.name}: stage {s.index} (Propagate, layer "
                    f"{self.layer_of[s.index] + 1}) weighs {s.in_dim} columns by the "
                    f"{seen_edge.heads} heads of stage {seen_edge.index} "
                    f"({type(seen_edge).__name__}), which do not divide them (head h weighs "
                    "the h-th of heads equal blocks of columns)")

    def forward(self, graph: Graph, norms: dict[str, Tensor], x: Tensor,
                ctx: StageContext) -> Tensor:
        """Reference execution on one device: every vertex, every edge, in order.

        Args:
            graph: the propagation graph (square, self-loops as ``self.self_loops``).
            norms: edge weights for each name in ``self.norms``, aligned with ``graph``.
            x: (N, in_dim) input features.
            ctx: rows are all vertices (``gids = arange(N)``), ``eids = arange(E)``.

        Returns:
            (N, out_dim) output rows (logits).
        """
        from fullgraph.models.walk import GraphRunner, walk  # walk builds on this module

        return walk(self, GraphRunner(graph, norms, ctx), x)


_CALLED_WITH = {"Transform": "x, ctx, layer_input", "EdgeTransform": "graph, x_dst, x_src, ctx"}
"""The arguments with which the walker calls each kind of stage a model may define."""


def sums_over_rows(stage: nn.Module) -> bool:
    """Whether ``stage`` reads statistics over every vertex: it declares
    ``reduces_rows`` (as a stage calling ``ctx.sum_rows`` must), or holds a global
    batch norm without declaring it."""
    from fullgraph.models.norm import GlobalBatchNorm

    return bool(getattr(stage, "reduces_rows", False)) or \
        any(isinstance(m, GlobalBatchNorm) for m in stage.modules())


def _check_edge_stage(stage: EdgeTransform, model: str, layer: int, width: int) -> None:
    """An E stage declares the width of the rows it reads, as every stage does, and a
    whole number of heads (the executors size its halo and its weights by them)."""
    where = f"model {model}: stage {stage.index} ({type(stage).__name__}, layer {layer + 1})"
    if not isinstance(getattr(stage, "in_dim", None), int):
        raise ValueError(f"{where}, an EdgeTransform, sets no in_dim (the columns of the "
                         f"rows it reads, {width} here): call super().__init__({width}) or "
                         "set self.in_dim = self.out_dim in its __init__")
    if not isinstance(stage.heads, int) or stage.heads < 1:
        raise ValueError(f"{where}: heads must be a whole number >= 1, got {stage.heads!r}")


def _check_forward(stage: Stage, model: str, layer: int) -> None:
    """Refuse a stage whose ``forward`` cannot take the arguments the walker gives it
    (a user's ``Transform.forward(self, x, ctx)`` fails at its first call otherwise)."""
    kind = "EdgeTransform" if isinstance(stage, EdgeTransform) else \
        "Transform" if isinstance(stage, Transform) else None
    if kind is None:
        return
    try:
        signature = inspect.signature(stage.forward, follow_wrapped=False)  # what is called
    except (TypeError, ValueError):  # no signature to read: it is called as it is
        return
    try:
        signature.bind(*_CALLED_WITH[kind].split(", "))
    except TypeError:
        raise ValueError(f"model {model}: stage {stage.index} ({type(stage).__name__}, layer "
                         f"{layer + 1}) has forward{signature}; a {kind}'s forward takes "
                         f"({_CALLED_WITH[kind]}{'=None' if kind == 'Transform' else ''})"
                         ) from None


def propagation_inputs(program: StageProgram, graph: Graph, dtype: torch.dtype = torch.float32,
                       in_degree: Tensor | None = None,
                       empty: Callable[[int, torch.dtype], Tensor] | None = None
                       ) -> tuple[Graph, dict[str, Tensor]]:
    """The graph a program propagates over (self-loops adjusted) and its edge norms.

    ``in_degree``: when ``graph`` holds only some in-edges (a per-part shard), every
    vertex's in-degree in the whole graph without self-loops, which the norms then
    use (plus the self-loop the program adds). ``empty``: makes the (E,) arrays the
    norms are written into (e.g. ``Spill.array``, files) instead of memory.
    """
    from fullgraph.graph.csr import NORMS

    if graph.has_self_loops() != program.self_loops or program.self_loops:
        graph = graph.with_self_loops(program.self_loops)
    degrees = None if in_degree is None else in_degree + int(program.self_loops)
    return graph, {name: NORMS[name](graph, dtype, degrees,
                                     None if empty is None else empty(graph.num_edges, dtype))
                   for name in sorted(program.norms)}
