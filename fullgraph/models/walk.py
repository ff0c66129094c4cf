"""The one program walker: how a stage program runs, whoever runs it.

Every executor runs the same rules; they live here once:
- a ``LayerInput`` stage opens a layer, and its output is the layer input that later
  T stages of the same layer read (SAGE / GIN root terms, residuals);
- an E stage produces edge weights, which the P stages with ``norm='edge'`` after it
  read (the most recent E stage before them);
- P and E stages read in-neighbour rows (the ones a row partition may not hold); T
  stages read only their own rows.

``describe(program)`` states those rules per stage as data (``StageInfo``), for the
analyses that walk a program backwards (which rows each stage needs, which values a
later phase imports). ``walk`` runs stages forward and asks a ``Runner`` only how a
stage obtains its inputs and where it runs: the default ``Runner`` is the
single-device semantics; executors override its hooks.

This module must not import ``fullgraph.comm`` or ``fullgraph.parallel``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch.utils.checkpoint
from torch import Tensor

from fullgraph.graph.csr import Graph
from fullgraph.graph.sparse import row_range
from fullgraph.models.norm import replaying
from fullgraph.models.stages import (
    UNDECLARED_SUM,
    EdgeTransform,
    LayerInput,
    Propagate,
    Stage,
    StageContext,
    StageKind,
    StageProgram,
    Transform,
    sums_over_rows,
)
from fullgraph.ops.dropout import deferred_output, mark_sole, marks_of, restore_marks


@dataclass(frozen=True)
class StageInfo:
    """What the walker knows about one stage of a program.

    Attributes:
        index: the stage's position in the program.
        kind: T, E or P.
        layer: the layer the stage belongs to.
        opens_layer: the stage is its layer's ``LayerInput`` (its output is the layer
            input).
        layer_input_from: for a T stage that reads the layer input, the index of the
            ``LayerInput`` stage that produced it (None otherwise).
        edge_weights_from: for a P stage with ``norm='edge'``, the index of the E
            stage whose weights it reads (None otherwise).
    """

    index: int
    kind: StageKind
    layer: int
    opens_layer: bool = False
    layer_input_from: int | None = None
    edge_weights_from: int | None = None

    @property
    def reads_neighbours(self) -> bool:
        """P and E stages read the rows of in-neighbours; T stages only their own."""
        return self.kind is not StageKind.TRANSFORM

    @property
    def is_transform(self) -> bool:
        return self.kind is StageKind.TRANSFORM

    @property
    def is_edge(self) -> bool:
        return self.kind is StageKind.EDGE

    @property
    def is_propagate(self) -> bool:
        return self.kind is StageKind.PROPAGATE


def describe(program: StageProgram) -> tuple[StageInfo, ...]:
    """One ``StageInfo`` per stage of ``program`` (computed once per program)."""
    infos = program.__dict__.get("_stage_infos")
    if infos is None or len(infos) != len(program.stages):
        infos = _describe(program)
        program.__dict__["_stage_infos"] = infos
    return infos


def _describe(program: StageProgram) -> tuple[StageInfo, ...]:
    infos: list[StageInfo] = []
    layer_input: int | None = None
    edge: int | None = None
    for s, stage in enumerate(program.stages):
        opens = isinstance(stage, LayerInput)
        if opens:
            layer_input = s
        if isinstance(stage, EdgeTransform):
            edge = s
        reads_li = isinstance(stage, Transform) and stage.uses_layer_input and not opens
        reads_edge = isinstance(stage, Propagate) and stage.norm == "edge"
        infos.append(StageInfo(s, stage.kind, program.layer_of[s], opens,
                               layer_input if reads_li else None,
                               edge if reads_edge else None))
    return tuple(infos)


def reads_sparse(program: StageProgram) -> bool:
    """Whether ``program`` can take sparse (CSR) input features: its first layer opens
    with dropout and every stage that reads the raw features after it is a T stage
    that takes CSR rows (a dense layer, not a propagation)."""
    return dense_reader(program) is None


def dense_reader(program: StageProgram) -> str | None:
    """Why ``program`` needs its input features dense (a stage of it reads them and
    does not take CSR rows), in words for the run header; None where it takes CSR."""
    stages, infos = program.stages, describe(program)
    if len(stages) < 2 or not isinstance(stages[0], LayerInput):
        return "it does not open with a layer input"
    if isinstance(stages[1], Propagate):
        return "it propagates the raw features (stage 1)"
    if getattr(stages[1], "lin", None) is None:  # the features' first reader has a weight
        return (f"stage 1 ({type(stages[1]).__name__}) reads the raw features without a "
                "weight as .lin, the nn.Linear whose product takes the dropped CSR rows")
    readers = [1] + [i.index for i in infos if i.layer_input_from == 0]
    for s in readers:
        st = stages[s]
        if not (isinstance(st, Transform) and st.reads_sparse):
            return (f"stage {s} ({type(st).__name__}) reads the raw features and does not "
                    "take CSR rows (a Transform that does declares reads_sparse)")
    return None


def has_edge_stage(program: StageProgram) -> bool:
    """Whether the program has an E stage (attention)."""
    return any(i.is_edge for i in describe(program))


def widest_slice(program: StageProgram, parts: int) -> int:
    """The most columns a worker propagates when each P stage's input columns are split
    evenly over ``parts`` workers (rounded up); 1 without P stages."""
    return max((-(-int(program.stages[i.index].in_dim) // parts)
                for i in describe(program) if i.is_propagate), default=1)


def out_dim(program: StageProgram, start: int, stop: int) -> int:
    """Columns of the rows the stages ``[start, stop)`` output (E stages output none)."""
    infos = describe(program)
    return [program.stages[s] for s in range(start, stop)
            if not infos[s].is_edge][-1].out_dim


@dataclass
class Carry:
    """Values a walk hands from one stage to later ones.

    Attributes:
        layer_inputs: LayerInput stage index -> its output rows.
        edge_weights: E stage index -> its edge weights.
    """

    layer_inputs: dict[int, Tensor] = field(default_factory=dict)
    edge_weights: dict[int, Tensor] = field(default_factory=dict)


def check_width(program: StageProgram, s: int, h: Tensor) -> None:
    """Refuse rows ``h`` that T stage ``s`` made of another width than it declares (a
    user's stage: a wider last layer trained over classes that do not exist)."""
    stage = program.stages[s]
    if h.dim() != 2 or h.shape[1] != stage.out_dim:
        from fullgraph.errors import ConfigError  # (the model's mistake: one line)

        raise ConfigError(f"model {program.name or type(program).__name__}: stage {s} "
                          f"({type(stage).__name__}, layer {program.layer_of[s] + 1}) "
                          f"declares {stage.out_dim} output columns but returned a tensor "
                          f"of shape {tuple(h.shape)}")


class Runner:
    """How each stage obtains its inputs and where it runs; the defaults run a stage
    on the rows given, which is the single-device semantics when the rows are all
    vertices. Executors override the hooks they need."""

    passes_rows_through = False
    """Whether ``transform`` hands a stage the rows ``h`` as they are (no selection or
    copy of its own): then a layer input that only the next stage's product reads need
    not be made (``transform_run``, ``ops.dropout.deferred_output``)."""

    def transform(self, s: int, stage: Stage, h: Tensor, layer_input: Tensor | None) -> Tensor:
        """Run T stage ``s`` on rows ``h`` (``layer_input``: its layer's input rows)."""
        raise NotImplementedError

    def edge(self, s: int, stage: Stage, h: Tensor) -> Tensor:
        """Run E stage ``s`` on rows ``h``; return the weights of its block's edges."""
        raise NotImplementedError

    def propagate(self, s: int, stage: Stage, h: Tensor, edge_weights: Tensor | None) -> Tensor:
        """Run P stage ``s`` on rows ``h`` (``edge_weights``: from an E stage, or None
        for a fixed normalisation)."""
        raise NotImplementedError

    def transform_run(self, stages: list[int], program: StageProgram, h: Tensor,
                      carry: Carry) -> Tensor:
        """Run consecutive T stages ``stages``; by default one after another, each
        reading its layer input from ``carry`` and a layer-opening stage adding its
        output there."""
        infos = describe(program)
        carried = last_readers(infos)
        for s in stages:
            src = infos[s].layer_input_from
            # a layer input read by the next stage alone, whose input the stage before
            # made for it alone: a product's backward may reuse that input's storage
            # (ops.dropout.Dropped.sole), and where the rows reach the next stage as
            # they are, its product rebuilds the dropped rows itself (deferred_output)
            sole = (infos[s].opens_layer and s - 1 in stages and s + 1 in stages
                    and s not in carried)
            defer = (sole and self.passes_rows_through
                     and getattr(program.stages[s + 1], "takes_dropped", False))
            stage = program.stages[s]
            token = UNDECLARED_SUM.set(None if sums_over_rows(stage) else
                                       f"{s} ({type(stage).__name__})")
            try:
                with deferred_output() if defer else contextlib.nullcontext():
                    h = self.transform(s, stage, h,
                                       None if src is None else carry.layer_inputs[src])
            finally:
                UNDECLARED_SUM.reset(token)
            check_width(program, s, h)
            if infos[s].opens_layer:
                carry.layer_inputs[s] = h
                if sole:
                    mark_sole(h)
        return h

    def propagate_run(self, stages: list[int], program: StageProgram, h: Tensor,
                      carry: Carry) -> Tensor:
        """Run consecutive P stages ``stages``; by default one after another."""
        infos = describe(program)
        for s in stages:
            src = infos[s].edge_weights_from
            h = self.propagate(s, program.stages[s], h,
                               None if src is None else carry.edge_weights[src])
        return h


def run_at(infos: tuple[StageInfo, ...], s: int, stop: int) -> list[int]:
    """The stages ``walk`` runs together from ``s`` (before ``stop``): an E stage alone,
    else the consecutive stages of its kind, T or P."""
    run = [s]
    if not infos[s].is_edge:
        while run[-1] + 1 < stop and infos[run[-1] + 1].kind is infos[s].kind:
            run.append(run[-1] + 1)
    return run


def walk(program: StageProgram, runner: Runner, h: Tensor, *, start: int = 0,
         stop: int | None = None, carry: Carry | None = None) -> Tensor:
    """Run stages ``[start, stop)`` of ``program`` on ``h`` through ``runner``.

    Args:
        program: the stage program.
        runner: the executor's hooks.
        h: the rows the first stage reads.
        start, stop: the stages to run (default: all).
        carry: layer inputs and edge weights from earlier stages; updated in place
            with the ones these stages produce (default: a fresh one).

    Returns:
        The rows the last stage outputs.
    """
    infos = describe(program)
    stop = len(infos) if stop is None else stop
    carry = Carry() if carry is None else carry
    last_read = last_readers(infos)
    s = start
    while s < stop:
        info = infos[s]
        if info.is_edge:
            carry.edge_weights[s] = runner.edge(s, program.stages[s], h)
            s += 1
            continue
        run = run_at(infos, s, stop)
        if info.is_propagate:
            h = runner.propagate_run(run, program, h, carry)
        else:
            h = runner.transform_run(run, program, h, carry)
        s = run[-1] + 1
        # let go of the values no later stage of the program reads (a layer input, or a
        # layer's attention weights, would otherwise live until the forward ends)
        for held in (carry.layer_inputs, carry.edge_weights):
            for k in [k for k in held if last_read.get(k, k) < s]:
                del held[k]
    return h


def needs_row_sums(program: StageProgram, stages: list[int]) -> bool:
    """Whether a stage of ``stages`` sums over every vertex (``sums_over_rows``), which
    a run over blocks of rows cannot do."""
    return any(sums_over_rows(program.stages[s]) for s in stages)


def blocked_transform_run(runner: Runner, stages: list[int], program: StageProgram, h: Tensor,
                          carry: Carry, ctx: StageContext, block_rows: int,
                          dtype: torch.dtype | None = None,
                          into: Callable[[int, int, torch.dtype], Tensor] | None = None
                          ) -> Tensor:
    """``runner.transform_run`` of ``stages``, ``block_rows`` rows at a time, keeping
    no activations: each block is recomputed in the backward pass. No (R, D) tensor of
    the run is held whole but its output (and, in the backward, its gradient), so a run
    whose hidden rows exceed memory still trains; ``h`` may be memory-mapped rows of
    another dtype (``dtype``: what the run computes in), read one block at a time.
    ``into(R, D, dtype)``, when given, makes the (R, D) matrix the output is written
    into (e.g. ``Spill.empty``, a file on disk; default: a new tensor).

    Exact: T stages are row-wise and their dropout is keyed by the rows' global ids
    (``ctx.gids``), so a block computes what the whole run computes for its rows. A
    stage that sums over every vertex (``needs_row_sums``) or a layer input read after
    the run (kept whole) makes it fall back to ``recomputed_transform_run``.
    """
    infos = describe(program)
    last_read = last_readers(infos)
    end = stages[-1] + 1
    if (needs_row_sums(program, stages) or h.shape[0] <= block_rows
            or any(infos[s].opens_layer and last_read.get(s, s) >= end for s in stages)):
        x = h if dtype is None else h.to(dtype)
        return recomputed_transform_run(runner, stages, program, x, carry)
    outside = sorted({src for s in stages if (src := infos[s].layer_input_from) is not None
                      and src not in stages})
    params = [q for s in stages for q in program.stages[s].parameters() if q.requires_grad]

    def block(lo: int, hi: int, x: Tensor, *layer_inputs: Tensor) -> Tensor:
        rows = BlockRows(StageContext(ctx.gids[lo:hi], ctx.seed, ctx.training))
        local = Carry(layer_inputs=dict(zip(outside, layer_inputs)))
        x = x if dtype is None else x.to(dtype)
        return Runner.transform_run(rows, stages, program, x, local)

    return _BlockedRun.apply(block, block_rows, len(params), into, h,
                             *(carry.layer_inputs[i] for i in outside), *params)


class BlockRows(Runner):
    """Runs T stages on one block of rows with the block's own context."""

    passes_rows_through = True

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx

    def transform(self, s: int, stage: Stage, h: Tensor, layer_input: Tensor | None) -> Tensor:
        return stage(h, self.ctx, layer_input)


class _BlockedRun(torch.autograd.Function):
    """Forward block by block without autograd; backward recomputes each block and
    sums its gradients (inputs: the rows, the outside layer inputs, the parameters)."""

    @staticmethod
    def forward(ctx, block, block_rows: int, num_params: int, into, h: Tensor,
                *rest: Tensor) -> Tensor:
        n = h.shape[0]
        ctx.block, ctx.block_rows, ctx.num_params = block, block_rows, num_params
        ctx.save_for_backward(h, *rest)
        layer_inputs = rest[:len(rest) - num_params]
        out: Tensor | None = None
        for lo in range(0, n, block_rows):
            hi = min(n, lo + block_rows)
            y = block(lo, hi, row_range(h, lo, hi), *(row_range(t, lo, hi) for t in layer_inputs))
            if out is None:
                out = (y.new_empty((n, *y.shape[1:])) if into is None or y.dim() != 2
                       else into(n, y.shape[1], y.dtype))
            out[lo:hi] = y
        assert out is not None
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, *rest = ctx.saved_tensors
        num_rows = len(rest) - ctx.num_params
        layer_inputs, params = rest[:num_rows], rest[num_rows:]
        row_inputs = [h, *layer_inputs]
        need = ctx.needs_input_grad[4:]
        row_grads = [torch.zeros_like(t) if need[i] else None for i, t in enumerate(row_inputs)]
        param_grads: list[Tensor | None] = [None] * len(params)
        for lo in range(0, h.shape[0], ctx.block_rows):
            hi = min(h.shape[0], lo + ctx.block_rows)
            with torch.enable_grad():
                leaves = [row_range(t, lo, hi).detach().requires_grad_(bool(need[i]))
                          for i, t in enumerate(row_inputs)]
                y = ctx.block(lo, hi, *leaves)
                wanted = [t for i, t in enumerate(leaves) if need[i]] + list(params)
                got = torch.autograd.grad(y, wanted, grad[lo:hi], allow_unused=True)
            k = 0
            for i in range(len(leaves)):
                if need[i]:
                    row_grad = row_grads[i]
                    if got[k] is not None and row_grad is not None:
                        row_grad[lo:hi] = got[k]
                    k += 1
            for j, g in enumerate(got[k:]):
                if g is not None:
                    prev = param_grads[j]
                    param_grads[j] = g if prev is None else prev + g
        return (None, None, None, None, *row_grads, *param_grads)


def last_readers(infos: tuple[StageInfo, ...]) -> dict[int, int]:
    """Stage index -> the last stage that reads its output through the carry."""
    last: dict[int, int] = {}
    for info in infos:
        for src in (info.layer_input_from, info.edge_weights_from):
            if src is not None:
                last[src] = info.index
    return last


def recomputed_transform_run(runner: Runner, stages: list[int], program: StageProgram,
                             h: Tensor, carry: Carry) -> Tensor:
    """``runner.transform_run`` of ``stages`` whose activations are not kept: autograd
    keeps only the run's inputs and recomputes the stages in the backward pass
    (``torch.utils.checkpoint``; NeutronTask §5.1 recomputation). Exact, because every
    stage is a deterministic function of its inputs, the step seed and the row ids
    (keyed dropout). The stages must not communicate (no ``ctx.row_sum``): they run
    again, on this worker alone, during the backward pass."""
    infos = describe(program)
    outside = sorted({src for s in stages if (src := infos[s].layer_input_from) is not None
                      and src not in stages})
    opened = [s for s in stages if infos[s].opens_layer]

    inputs = (h, *(carry.layer_inputs[i] for i in outside))
    # a keyed dropout's record on an input (``ops.dropout``): the recomputation gets
    # unpacked copies of the inputs, which must read as the originals did
    marks = [marks_of(t) for t in inputs]

    runs = [0]

    def region(x: Tensor, *layer_inputs: Tensor) -> tuple[Tensor, ...]:
        for t, mark in zip((x, *layer_inputs), marks):
            restore_marks(t, mark)
        local = Carry(layer_inputs=dict(zip(outside, layer_inputs)))
        runs[0] += 1  # the second run is the backward's: no running statistics again
        with replaying() if runs[0] > 1 else contextlib.nullcontext():
            out = Runner.transform_run(runner, stages, program, x, local)
        return (out, *(local.layer_inputs[s] for s in opened))

    outs = torch.utils.checkpoint.checkpoint(region, *inputs, use_reentrant=False)
    for s, value in zip(opened, outs[1:]):
        carry.layer_inputs[s] = value
    return outs[0]


class GraphRunner(Runner):
    """Every vertex of one graph on one device: the reference semantics.

    Args:
        graph: the propagation graph.
        norms: its fixed edge weights per normalisation name.
        ctx: the context of all rows (``gids = arange(N)``, ``eids = arange(E)``).
    """

    passes_rows_through = True

    def __init__(self, graph: Graph, norms: dict[str, Tensor], ctx: StageContext) -> None:
        self.graph, self.norms, self.ctx = graph, norms, ctx

    def transform(self, s: int, stage: Stage, h: Tensor, layer_input: Tensor | None) -> Tensor:
        return stage(h, self.ctx, layer_input)

    def edge(self, s: int, stage: Stage, h: Tensor) -> Tensor:
        return stage(self.graph, h, h, self.ctx)

    def propagate(self, s: int, stage: Stage, h: Tensor, edge_weights: Tensor | None) -> Tensor:
        if edge_weights is None:
            edge_weights = self.norms[cast(Propagate, stage).norm]
        return stage(self.graph, h, edge_weights)
