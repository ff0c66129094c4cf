"""Speed-proportional shares for tensor parallelism (beyond NeutronCloud).

NeutronCloud adapts data parallelism by moving dependencies between fetching and
recomputing. Tensor parallelism has no dependencies to move, but every worker's
work is set by two splits: its block of vertex rows (T and E stages) and its slice of
every propagation's columns (P stages). ``ShareBalancer`` sets both in proportion to
each worker's measured speed, so that a slowed-down worker gets less to do and the
others stop waiting for it at every split and gather.

After every epoch (``between_epochs``, collective):
- each worker's compute seconds (wall - transfer - waiting, ``EpochProfile``) are
  gathered; its work is the mean of its fraction of the rows and its fraction of the
  propagated columns (from the plan, the same on every worker); speed = work /
  compute seconds;
- each worker's speed is the median of the last ``WINDOW`` epochs (damping noise),
  the first ``WARMUP`` epochs left out;
  the target shares are the speeds normalised, none below ``floor_share``;
- the plan is switched (``TensorParallel.replan``) only when some worker's share
  changes by more than ``THRESHOLD`` of itself, so equal speeds never re-plan.

Exact: a switch changes only where rows and columns are computed, so training equals
the single-process executor whatever the shares.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fullgraph.adapt.base import Adapter, Note
from fullgraph.comm import primitives as prim
from fullgraph.models.walk import describe

WINDOW = 5
"""Epochs whose measured speeds are combined (median) for one decision."""
WARMUP = 1
"""First epochs not measured (one-time costs: lazily built indexes, allocator growth),
counted from the first epoch the process runs (after a resume, its first too)."""
MIN_SHARE = 0.05
"""No worker's share falls below this fraction of the whole, or half an equal share
where that is less (21 workers and more: ``floor_share``)."""
THRESHOLD = 0.1
"""Re-plan only when a worker's share changes by more than this fraction of itself."""

SpeedsFor = Callable[[int, list[float]], Sequence[float]]


def target_shares(speeds: Sequence[float], min_share: float = MIN_SHARE) -> list[float]:
    """Shares proportional to ``speeds`` (summing to 1), none below ``min_share``:
    the workers held at the minimum are fixed there and the rest re-normalised."""
    world = len(speeds)
    if world == 0 or min_share * world > 1 or any(not s > 0 for s in speeds):
        raise ValueError(f"target_shares: need positive speeds and min_share * workers <= 1, "
                         f"got {list(speeds)} and {min_share}")
    floor: set[int] = set()
    while True:
        free = [r for r in range(world) if r not in floor]
        rest = 1.0 - min_share * len(floor)
        total = sum(speeds[r] for r in free)
        shares = [min_share if r in floor else rest * speeds[r] / total for r in range(world)]
        low = {r for r in free if shares[r] < min_share}
        if not low:
            return shares
        floor |= low


def floor_share(world: int) -> float:
    """The least share of a worker among ``world``: ``MIN_SHARE``, or half an equal share
    where that is less, so that the floors of all workers never exceed the whole."""
    return min(MIN_SHARE, 0.5 / world)


def changed(current: Sequence[float], target: Sequence[float],
            threshold: float = THRESHOLD) -> bool:
    """Whether some worker's share moves by more than ``threshold`` of its current one."""
    return any(abs(t - c) > threshold * c for c, t in zip(current, target))


def work_fractions(program: Any, plan: Any) -> list[float]:
    """Each worker's part of the work: the mean of its fraction of the vertex rows and
    its fraction of all propagated columns (rows alone without P stages)."""
    world, n = plan.comm.world_size, sum(plan.row_counts)
    rows = [c / n for c in plan.row_counts]
    cols = [0] * world
    for info, stage in zip(describe(program), program.stages):
        if info.is_propagate:
            layout = plan.layout(stage.in_dim)
            cols = [c + layout.local_cols(r) for r, c in enumerate(cols)]
    if not sum(cols):
        return rows
    return [(a + b / sum(cols)) / 2 for a, b in zip(rows, cols)]


class ShareBalancer(Adapter):
    """Rows and columns of tensor parallelism in proportion to measured speed.

    Args:
        strategy: the ``TensorParallel`` strategy whose plan is re-shared.
        plan: its plan (after ``setup``).
        note: where decisions go (``Profiler.note``).
        speeds_for: (epoch, smoothed measured speeds) -> speeds to use instead (tests
            force switches with it); None: measured.
    """

    def __init__(self, strategy: Any, plan: Any, note: Note,
                 speeds_for: SpeedsFor | None = None) -> None:
        self.strategy, self.note, self.speeds_for = strategy, note, speeds_for
        world = plan.comm.world_size
        given = plan.shares if plan.shares is not None else (1.0,) * world
        self.shares = [w / sum(given) for w in given]
        self.min_share = floor_share(world)
        self.history: list[list[float]] = []
        self.smooth: list[float] = []
        self.start: int | None = None

    def header(self) -> list[str]:
        return [f"adapt    adjust (exact): tensor rows and columns re-split after every epoch "
                f"in proportion to each worker's measured compute speed (median of {WINDOW} "
                f"epochs, share >= {self.min_share:.1%}, re-planned on a change over "
                f"{THRESHOLD:.0%})"]

    def measure(self, model: Any, plan: Any, profile: Any) -> list[float]:
        """Every worker's work per compute second in the epoch just run (collective)."""
        comm = plan.comm
        seconds = torch.zeros(comm.world_size, dtype=torch.float64)
        seconds[comm.rank] = profile.compute_s
        if comm.world_size > 1:
            prim.all_reduce_(seconds, comm, "adjust")
        work = work_fractions(model, plan)
        return [w / max(s, 1e-9) for w, s in zip(work, seconds.tolist())]

    def decide(self, speeds: Sequence[float], epoch: int) -> list[float] | None:
        """Record this epoch's measured speeds; the new shares (now current), or None
        to keep the current ones."""
        if self.start is None:
            self.start = epoch  # the first epoch this process runs (a resume: later)
        if epoch - self.start < WARMUP and self.speeds_for is None:
            return None
        self.history = (self.history + [list(speeds)])[-WINDOW:]
        self.smooth = [statistics.median(h[r] for h in self.history) for r in range(len(speeds))]
        if self.speeds_for is not None:
            self.smooth = [float(s) for s in self.speeds_for(epoch, self.smooth)]
        target = target_shares(self.smooth, self.min_share)
        if not changed(self.shares, target):
            return None
        self.shares = target
        return target

    def between_epochs(self, model: Any, plan: Any, epoch: int, profile: Any) -> None:
        if plan.comm.world_size == 1:
            return
        t0 = time.perf_counter()
        target = self.decide(self.measure(model, plan, profile), epoch)
        if target is not None:
            self.strategy.replan(model, plan, target)
        self.note({"kind": "shares", "shares": list(self.shares), "speeds": self.smooth,
                   "rows": list(plan.row_counts), "switched": target is not None,
                   "seconds": time.perf_counter() - t0})
