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
  changes by more than ``THRESHOLD`` of itself and the slowest worker's compute time
  is more than ``THRESHOLD`` above the mean, so equal speeds never re-plan;
- every switch is a trial, judged after the next epoch (``_judge``): a balancing
  switch stays where the slowest worker's time fell by at least half of what the
  proportional model predicted, and is undone otherwise (a fixed cost of one worker
  or noise, not its speed, made it slowest), the next one waiting twice as long;
- a worker left below its first share is given work back by probes: after
  ``probe_wait`` epochs without a switch its share is doubled (at most back to its
  first share). Where its compute time grows with the share (elasticity above
  ``ELASTIC``: it is still slow) the shares go back and the wait doubles; where it
  does not (its slowdown is over, or its compute is mostly a fixed cost the share does
  not shrink, as on small graphs) the new shares stay and its speed is measured
  afresh. Without probes a worker whose compute does not shrink with its share looks
  as slow as its share is small, and stays there.

Exact: a switch changes only where rows and columns are computed, so training equals
the single-process executor whatever the shares.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fullgraph.adapt.base import Adapter, Note, resumed_line
from fullgraph.comm import primitives as prim
from fullgraph.models.walk import describe

WINDOW = 5
"""Epochs whose measured speeds are combined (median) for one decision."""
WARMUP = 1
"""First epochs not measured (one-time costs: lazily built indexes, allocator growth),
counted from the first epoch the process runs (after a resume, its first too)."""
MIN_SHARE = 0.05
"""No worker's share falls below this fraction of the whole, or half an equal share
where that is less (more than 10 workers: ``floor_share``)."""
THRESHOLD = 0.1
"""Re-plan only when a worker's share changes by more than this fraction of itself."""
MIN_SAMPLES = 3
"""Epochs measured at the current shares before a balancing trial starts (after a
switch that stayed, the window starts afresh)."""
ELASTIC = 0.5
"""A probe is undone where the probed worker's compute time grew by more than this
power of its share's growth (1: in proportion, as work that takes its time; 0: not at
all, as a fixed cost)."""

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
        self.unset = plan.shares is None  # the first split is setup's, not shares'
        self.shares = [w / sum(given) for w in given]
        self.min_share = floor_share(world)
        self.first = list(self.shares)
        self.history: list[list[float]] = []
        self.seconds: list[list[float]] = []
        self.smooth: list[float] = []
        self.start: int | None = None
        self.quiet = 0  # measured epochs since the last switch
        self.probe_wait, self.balance_wait = WINDOW, 0
        self.trial: dict[str, Any] | None = None

    def header(self) -> list[str]:
        return [f"adapt    adjust (exact): tensor rows and columns re-split after every epoch "
                f"in proportion to each worker's measured compute speed (median of {WINDOW} "
                f"epochs, share >= {self.min_share:.1%}, re-planned on a change over "
                f"{THRESHOLD:.0%} with uneven times, each switch undone after one epoch "
                f"that does not bear it out; a worker below its first share probed with "
                f"twice its share after {WINDOW}+ quiet epochs)"] \
            + resumed_line(self, "the starting shares")

    def measure(self, model: Any, plan: Any, profile: Any) -> tuple[list[float], list[float]]:
        """Every worker's work per compute second in the epoch just run, and its compute
        seconds (collective)."""
        comm = plan.comm
        seconds = torch.zeros(comm.world_size, dtype=torch.float64)
        seconds[comm.rank] = profile.compute_s
        if comm.world_size > 1:
            prim.all_reduce_(seconds, comm, "adjust")
        work = work_fractions(model, plan)
        spent = seconds.tolist()
        return [w / max(s, 1e-9) for w, s in zip(work, spent)], spent

    def decide(self, speeds: Sequence[float], epoch: int,
               seconds: Sequence[float] | None = None) -> list[float] | None:
        """Record this epoch's measured speeds (and compute seconds, which the trials
        need: without them a switch is final and there are no probes); the new shares
        (now current), or None to keep the current ones."""
        if self.start is None:
            self.start = epoch  # the first epoch this process runs (a resume: later)
        if epoch - self.start < WARMUP and self.speeds_for is None:
            return None
        if self.speeds_for is not None:
            seconds = None  # forced speeds decide alone (tests): no trials, no probes
        if self.trial is not None and seconds is not None:
            return self._judge(speeds, seconds)
        self.history = (self.history + [list(speeds)])[-WINDOW:]
        if seconds is not None:
            self.seconds = (self.seconds + [list(seconds)])[-WINDOW:]
        self.smooth = [statistics.median(h[r] for h in self.history) for r in range(len(speeds))]
        if self.speeds_for is not None:
            self.smooth = [float(s) for s in self.speeds_for(epoch, self.smooth)]
        self.quiet += 1
        target = target_shares(self.smooth, self.min_share)
        if changed(self.shares, target) and self._unbalanced():
            if seconds is None:
                return self._switch(target)
            if self.quiet > self.balance_wait and len(self.seconds) >= MIN_SAMPLES:
                return self._start("balance", target)
        if seconds is None or self.quiet < self.probe_wait or len(self.seconds) < WINDOW:
            return None
        return self._probe()

    def _times(self) -> list[float]:
        """Every worker's median compute seconds over the window."""
        return [statistics.median(t[r] for t in self.seconds)
                for r in range(len(self.seconds[0]))]

    def _unbalanced(self) -> bool:
        """Whether the slowest worker's compute time (median over the window) exceeds
        the mean by more than ``THRESHOLD``: where the times are even, shares that the
        speeds would change leave the epoch as it is (compute that does not shrink with
        a share, as a fixed cost, makes speeds follow the shares and the shares walk with
        the noise). True where no times were given."""
        if not self.seconds:
            return True
        times = self._times()
        return max(times) > (1 + THRESHOLD) * statistics.fmean(times)

    def _switch(self, target: list[float]) -> list[float]:
        self.shares, self.quiet = list(target), 0
        return self.shares

    def _start(self, kind: str, target: list[float], rank: int | None = None) -> list[float]:
        """Switch to ``target`` on trial: ``_judge`` keeps or undoes it after one epoch."""
        self.trial = {"kind": kind, "rank": rank, "shares": list(self.shares),
                      "times": self._times(), "history": list(self.history),
                      "seconds": list(self.seconds)}
        return self._switch(target)

    def _probe(self) -> list[float] | None:
        """Double the share of the worker furthest below its first share (at most back
        to it), the others' scaled to fill the rest; None where no worker is below."""
        low = [r for r, (s, f) in enumerate(zip(self.shares, self.first))
               if s < f * (1 - THRESHOLD)]
        if not low:
            return None
        rank = min(low, key=lambda r: self.shares[r] / self.first[r])
        share = min(self.first[rank], 2 * self.shares[rank])
        rest = sum(s for r, s in enumerate(self.shares) if r != rank)
        target = [share if r == rank else s * (1 - share) / rest
                  for r, s in enumerate(self.shares)]
        return self._start("probe", target, rank)

    def _judge(self, speeds: Sequence[float], seconds: Sequence[float]) -> list[float] | None:
        """After a trial's epoch, keep the new shares or go back to the old ones:

        - a probe is undone where the probed worker's time grew with its share (by more
          than the ``ELASTIC`` power of the share's growth): it is still slow;
        - a balancing switch is undone where the slowest time did not fall by half of
          what shares in proportion to the measured speeds predicted: the speeds were
          not what limits the epoch (a fixed cost of one worker, noise); and where a
          worker that lost work took less than half the time its new share predicts:
          it got faster (its slowdown ended with the switch), so the speeds the
          switch followed are gone, and the fall of the slowest time is not the
          switch's.

        An undone trial doubles the wait before the next of its kind; a kept one
        measures afresh from this epoch."""
        trial, self.trial = self.trial, None
        assert trial is not None
        before, times = trial["shares"], trial["times"]
        if trial["kind"] == "probe":
            rank = trial["rank"]
            grew = self.shares[rank] / before[rank]
            took = max(seconds[rank], 1e-9) / max(times[rank], 1e-9)
            undo = math.log(max(took, 1e-9)) > ELASTIC * math.log(grew)
        else:
            predicted = max(t * new / max(old, 1e-12)
                            for t, new, old in zip(times, self.shares, before))
            gain = max(0.0, 1 - predicted / max(times))
            recovered = any(took < t * new / max(old, 1e-12) / 2 for took, t, new, old
                            in zip(seconds, times, self.shares, before) if new < old)
            undo = max(seconds) > max(times) * (1 - gain / 2) or recovered
        wait = "probe_wait" if trial["kind"] == "probe" else "balance_wait"
        if undo:
            setattr(self, wait, max(WINDOW, 2 * getattr(self, wait)))
            # the speeds and times measured at the shares restored
            self.history, self.seconds = trial["history"], trial["seconds"]
            return self._switch(before)
        setattr(self, wait, WINDOW if trial["kind"] == "probe" else 0)
        self.history, self.seconds = [list(speeds)], [list(seconds)]
        return None

    def between_epochs(self, model: Any, plan: Any, epoch: int, profile: Any) -> None:
        if plan.comm.world_size == 1:
            return
        t0 = time.perf_counter()
        judged = self.trial["kind"] if self.trial is not None else None
        speeds, seconds = self.measure(model, plan, profile)
        target = self.decide(speeds, epoch, seconds)
        if target is not None:  # back to the first shares: to the first split itself
            self.strategy.replan(model, plan, None if self.unset and target == self.first
                                 else target)
        self.note({"kind": "shares", "shares": list(self.shares), "speeds": self.smooth,
                   "rows": list(plan.row_counts), "switched": target is not None,
                   "trial": self.trial["kind"] if self.trial is not None else None,
                   "judged": None if judged is None else
                   f"{judged} {'undone' if target is not None else 'kept'}",
                   "seconds": time.perf_counter() - t0})
