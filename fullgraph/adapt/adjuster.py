"""Online DepCache / DepComm adjustment of data parallelism (NeutronCloud §4.2).

At start (``OnlineAdjuster.__init__``, collective): Algorithm 2 over this worker's
direct remote dependencies (``fullgraph.parallel.adjust.preprocess``), ordered by
DepCache cost at the unit costs the data strategy measured or was given; a starting
plan (``--dep-mode depcache`` or hybrid's choice) whose cached set takes more than
``--cache-budget`` is cut to Algorithm 3's set at those costs before the first epoch.

After every epoch (``between_epochs``, collective): this worker's unit costs are
measured from the epoch just run, Algorithm 3 (``adjust``) picks the DepCache set
within ``--cache-budget``, and if any worker's set changed by more than
``MIN_CHANGE`` of its dependencies, every worker switches its plan through
``DataParallel.replan`` (only index tables change; no feature data
moves: every worker holds the replicated inputs). The switch is exact: training
equals the single-process executor whatever the sets are.

Measured unit costs (this worker's own, per epoch, the median of the last
``WINDOW`` epochs to damp noise):
- T_v', T_e': the training forward's T-stage and P / E-stage seconds (``StageClock``)
  per row x column and per edge x column, scaled so that together they account for
  all of this worker's compute time in the epoch (wall - transfer - waiting): the
  backward pass and the rest are charged to the stages in proportion;
- T_c': the halo exchanges' transfer seconds (waiting for peers excluded, see
  ``fullgraph.profile``) per byte moved; an epoch that moved no halo bytes uses
  the per-byte cost measured at start (a bulk all-to-all), so a worker that caches
  everything can still go back to fetching. The collective exchange cannot tell
  peers apart, so with more than one peer a probe (``comm.tagged.probe_links``:
  ``PROBE_BYTES`` from every worker to every other at once) splits it: T'_c,i,j is
  T_c' times peer j's probe time over the mean of the peers' (when the slowest link
  is at least ``LINK_SPREAD`` times the fastest; otherwise one value for all). The
  probe runs at the first ``WINDOW`` adjustments, then at every ``PROBE_EVERY``-th
  (it cost 15-21 ms an adjustment on 3-5 workers of one host); the split of the
  last probes stands in between.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from fullgraph.adapt.base import Adapter, Note, resumed_line
from fullgraph.comm import primitives as prim
from fullgraph.comm.tagged import probe_links, tagged_messages
from fullgraph.parallel import costmodel
from fullgraph.parallel.adjust import Decision, adjust, preprocess
from fullgraph.parallel.data import DataParallel, DataPlan, StageClock
from fullgraph.runlog import fmt_bytes

WINDOW = 3
"""Epochs whose measured unit costs are combined (median) for one adjustment."""
PROBE_BYTES = 64 * 1024
"""Bytes each worker sends to each other one to tell their links apart (per adjustment)."""
PROBE_EVERY = 4
"""After the first ``WINDOW`` adjustments, the links are probed at every this many."""
LINK_SPREAD = 1.5
"""Peers' links are told apart only when their probe times differ by this factor."""
MIN_CHANGE = 0.02
"""Plans switch only when some worker would move more than this share of its
dependencies (a switch rebuilds every worker's row plan and exchange tables), or
holds more than the cache budget."""

RatesFor = Callable[[int, Any], costmodel.Rates]


class OnlineAdjuster(Adapter):
    """Algorithm 3 after every epoch, on the plan of a ``DataParallel`` strategy.

    Args:
        strategy: the data-parallel strategy whose plan is adjusted.
        model: the stage program.
        plan: its plan (after ``setup``).
        budget_bytes: the cache budget C_i (None: no limit).
        note: where adjustment events go (``Profiler.note``).
        rates_for: (epoch, profile) -> unit costs, replacing the measurement (tests
            force switches with it); None: measured.
        partial: under ``--adapt adjust+partial`` (its exchanges' waits are not split
            from transfer: the per-byte cost is not re-measured from them).
    """

    def __init__(self, strategy: DataParallel, model: Any, plan: DataPlan,
                 budget_bytes: float | None, note: Note, rates_for: RatesFor | None = None,
                 *, partial: bool = False) -> None:
        self.strategy, self.budget, self.note, self.rates_for = \
            strategy, budget_bytes, note, rates_for
        self.partial = partial
        self.approximate = partial  # the partial reduce it runs beside is (not with K=1)
        t0 = time.perf_counter()
        if plan.deps.rates is None:
            plan.deps.rates = costmodel.resolve_rates(plan.comm, plan.graph, None, None, None)
        self.start_rates = plan.deps.rates
        itemsize = torch.empty(0, dtype=plan.dtype).element_size()
        owned = plan.book.part_to_gids(plan.comm.rank)
        work = costmodel.dependency_work(model, plan.graph, owned, plan.deps.direct, itemsize)
        owner = plan.book.part_of[plan.deps.direct].numpy()
        self.pre = preprocess(work, owner, self.start_rates)
        self.storage = work.storage  # (R,) formula 12, in the dependency order
        self.preprocess_s = time.perf_counter() - t0
        if plan.device.type == "cpu":
            plan.clock = StageClock()
        self.history: list[costmodel.Rates] = []
        self.probes: list[list[float]] = []
        self.adjustments = 0  # made so far (the same count on every rank)
        self.byte = self.start_rates.byte
        note({"kind": "preprocess", "seconds": self.preprocess_s, "dependencies": self.pre.size})
        self._fit_budget(model, plan)

    def _over_budget(self, cached: torch.Tensor) -> bool:
        return self.budget is not None and \
            float(self.storage[cached.numpy()].sum()) > self.budget

    def _fit_budget(self, model: Any, plan: DataPlan) -> None:
        """Cut a starting plan that caches more than the budget (collective)."""
        over = torch.tensor([int(self._over_budget(plan.deps.cached))])
        if plan.comm.world_size > 1:
            prim.all_reduce_(over, plan.comm, "adjust", op="max")
        if not int(over):
            return
        t0 = time.perf_counter()
        decision = adjust(self.pre, self.start_rates, self.budget)
        cached = torch.from_numpy(decision.cached) if self._over_budget(plan.deps.cached) \
            else plan.deps.cached
        self.strategy.replan(model, plan, cached)
        plan.deps.budget_cut = True
        event = _event(decision, self.start_rates, True, time.perf_counter() - t0)
        event["at"] = "start: the starting plan cached more than the budget"
        self.note(event)

    def header(self) -> list[str]:
        budget = "no limit" if self.budget is None else fmt_bytes(self.budget)
        exact = "its choices exact, the partial reduce above not" if self.approximate \
            else "exact"
        return [f"adapt    adjust ({exact}): DepCache/DepComm re-chosen after every epoch from "
                f"measured costs, cache budget {budget}; preprocessing "
                f"{self.preprocess_s:.3f} s on rank 0"] \
            + resumed_line(self, "--dep-mode's starting plan")

    def measure(self, plan: DataPlan, profile: Any) -> costmodel.Rates:
        """This epoch's unit costs on this worker (see the module docstring)."""
        seconds, units = plan.clock.take() if plan.clock is not None else ({}, {})
        timed = seconds.get("T", 0.0) + seconds.get("PE", 0.0)
        scale = max(1.0, profile.compute_s / timed) if timed > 0 else 1.0
        start = self.start_rates
        vertex = scale * seconds["T"] / units["T"] if units.get("T") else start.vertex
        edge = scale * seconds["PE"] / units["PE"] if units.get("PE") else start.edge
        moved = sum(profile.bytes_sent.get(p, 0) + profile.bytes_recv.get(p, 0)
                    for p in ("halo", "halo-grad")) / 2
        transfer = sum(profile.comm_by_phase.get(p, 0.0) for p in ("halo", "halo-grad"))
        # a worker that fetched nothing cannot see its link: it prices it as measured at
        # start, or it would keep caching everything on one epoch's latency-bound rate
        if moved == 0:
            self.byte = self.start_rates.byte
        elif not (self.partial and not profile.waiting_split):
            self.byte = transfer / moved
        # else: partial reduce's tagged messages complete in other orders on the ranks,
        # so waiting is not split from transfer: the halo time holds the waits for late
        # peers (50-100x the per-byte cost on Cora), and the last cost measured stands
        return costmodel.Rates(self.byte, edge, vertex, ("byte", "edge", "vertex"))

    def between_epochs(self, model: Any, plan: Any, epoch: int, profile: Any) -> None:
        t0 = time.perf_counter()
        if self.rates_for is not None:
            rates = self.rates_for(epoch, profile)
            if plan.clock is not None:
                plan.clock.take()
        else:
            self.history = (self.history + [self.measure(plan, profile)])[-WINDOW:]
            rates = _median(self.history)
        per_owner = self.per_owner(plan, rates.byte) if self.rates_for is None else None
        decision = adjust(self.pre, rates, self.budget, per_owner)
        cached = torch.from_numpy(decision.cached)
        moved = int((cached != plan.deps.cached).sum())
        wanted = moved > MIN_CHANGE * cached.numel() or \
            moved > 0 and self._over_budget(plan.deps.cached)
        changed = torch.tensor([int(wanted)])
        if plan.comm.world_size > 1:
            prim.all_reduce_(changed, plan.comm, "adjust", op="max")
        if int(changed):
            self.strategy.replan(model, plan, cached)
        event = _event(decision, rates, bool(int(changed)), time.perf_counter() - t0)
        event["byte_per_owner"] = per_owner
        self.note(event)

    def per_owner(self, plan: DataPlan, byte: float) -> dict[int, float] | None:
        """T'_c,i,j: the per-byte cost split over the peers by a link probe (every
        rank sends ``PROBE_BYTES`` to every other at once; a collective exchange
        cannot tell its peers apart). Each peer's share is its probe time over the
        mean, the median of the last ``WINDOW`` probes; None with one peer, and on a
        backend that cannot match messages by tag (NCCL: the probe's separate receives
        and sends would deadlock there; every peer's link is then priced alike)."""
        comm = plan.comm
        if comm.world_size <= 2 or not tagged_messages(comm):
            return None
        self.adjustments += 1
        peers = [p for p in range(comm.world_size) if p != comm.rank]
        if self.adjustments <= WINDOW or self.adjustments % PROBE_EVERY == 0:  # collective
            times = probe_links(comm, PROBE_BYTES)
            mean = statistics.fmean(times[p] for p in peers) or 1.0
            self.probes = (self.probes + [[times[p] / mean for p in peers]])[-WINDOW:]
        shares = [statistics.median(r[i] for r in self.probes) for i in range(len(peers))]
        if max(shares) < LINK_SPREAD * min(shares):
            return None  # links alike (one host): probe noise must not move the plan
        return {p: byte * share for p, share in zip(peers, shares)}


def _median(history: list[costmodel.Rates]) -> costmodel.Rates:
    return costmodel.Rates(statistics.median(r.byte for r in history),
                           statistics.median(r.edge for r in history),
                           statistics.median(r.vertex for r in history), history[-1].measured)


def _event(decision: Decision, rates: costmodel.Rates, switched: bool,
           seconds: float) -> dict[str, Any]:
    cached = int(decision.cached.sum())
    return {"kind": "adjust", "cached": cached, "fetched": int(decision.cached.size - cached),
            "wanted": decision.wanted, "demand_bytes": decision.demand,
            "budget_bound": decision.budget_bound, "switched": switched, "seconds": seconds,
            "rates": {"byte": rates.byte, "edge": rates.edge, "vertex": rates.vertex}}
