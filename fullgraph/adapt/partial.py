"""Partial reduce (NeutronCloud §5): go on without a straggler for a bounded time.

``--adapt adjust+partial`` adds two approximations to online adjustment, both
bounded by ``--staleness K``:

- **Partial computation** (§5.2). The data strategy's halo exchanges become
  deadline-bounded (``fullgraph.comm.stale``): each exchange point (a P / E stage,
  forward or backward) gets a baseline T0 (the usual time from the previous point
  to this one over the last ``WINDOW`` full-synchronisation epochs,
  the first epoch left out: it carries one-off setup costs) and waits at most until
  (1 + alpha) T0 after the previous point; a peer that missed it is replaced by its
  historical rows, at most K epochs old (older: the worker waits). The paper fixes
  T0 after a warm-up; here it follows the later synchronisations, so a slowdown
  during the warm-up (which would otherwise raise T0 for the whole run) counts only
  until clean synchronisations come (``usual``), and a plan's change of cost is
  followed.
- **Partial update** (§5.3). After its backward pass a worker marks itself ready in
  the process group's store. Once every worker is ready, or the step's deadline
  (1 + alpha) T0_step from its start has passed with a majority (M // 2 + 1) ready,
  the first worker to propose fixes the ready set S (``tagged.agree``). The members
  send their gradients and local losses to S's lowest rank (the leader), which sums
  them in rank order and sends the result to every worker. A worker outside S
  applies the same result, so parameters and optimiser states stay equal
  everywhere. What stands in for the left-out workers' gradients
  (``--late-gradients``):

  - ``rescale`` (the paper's formula 14): each parameter's sum is scaled by
    N^(h) / N_S^(h) (formula 13: the training-related vertices h hops from the
    training set over all workers, over those of S; h is the number of propagations
    the parameter's stage feeds).
  - ``reuse`` (the default): a left-out worker still sends its gradient to the
    leader once it has it, late; the leader keeps the latest one of each worker and
    adds it, when at most K epochs old, in place of the missing one (the historical
    gradient, as partial computation uses historical rows). Formula 14 scales for
    the workers with none. A METIS part can hold most of a class's training
    vertices (on Coauthor CS, 13 of 15 classes have 80 % or more on one of 4
    parts): rescaling the others' gradients cannot stand in for that class, while
    its slightly old gradient does.

Every K-th epoch after the ``WARMUP`` epochs, and the warm-up and last epochs,
are full synchronisations: every receive in flight is completed, the halo
exchanges wait for every peer and the gradients are all-reduced exactly, so a
straggler is never more than K - 1 epochs behind. Evaluation and the metrics
exchange run on those epochs only (``collective_epoch``), the (collective) online
adjustment right before them, so that a new plan's first epoch fills the
historical rows of the vertices it starts to fetch.
"""
from __future__ import annotations

import collections
import itertools
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fullgraph.adapt.base import Adapter, Note
from fullgraph.comm import primitives as prim
from fullgraph.comm.group import Comm
from fullgraph.comm.primitives import CommError
from fullgraph.comm.stale import POINTS_PER_EPOCH, EpochStats, Point, StaleHalo
from fullgraph.comm.tagged import (
    TAG_BASE,
    Outbox,
    Tagged,
    agree,
    post_recv,
    post_send,
    require_tagged,
    store_of,
)
from fullgraph.graph.blocks import in_edges
from fullgraph.models.walk import describe

WARMUP = 3
"""Full-synchronisation epochs at the start, which set the first baselines T0."""
WINDOW = 9
"""The full-synchronisation epochs whose times set the baselines T0 (``usual``)."""
PHASE = "partial-update"
_RUNS = itertools.count()


def usual(times: Sequence[float]) -> float:
    """A step's usual time: the lower quartile of ``times``, the smallest of fewer than
    4 (a full synchronisation waits for every worker, so a slowed worker's epochs are
    among them; they raise it only when they are three quarters of them, or all)."""
    if len(times) < 4:
        return float(min(times))
    return statistics.quantiles(sorted(times), n=4, method="inclusive")[0]


class PartialReduce(Adapter):
    """Partial computation and partial update on a data-parallel plan.

    Args:
        strategy: the ``DataParallel`` strategy (its ``grad_sync`` is taken over).
        model: the stage program.
        plan: its ``DataPlan`` (its ``stale`` halo is set).
        staleness: K.
        slack: alpha.
        epochs: the run's last epoch.
        note: where events go (``Profiler.note``).
        warmup: full-synchronisation epochs at the start (default: ``WARMUP``).
        late_gradients: ``reuse`` or ``rescale`` (see the module docstring).
    """

    local_between = True

    def __init__(self, strategy: Any, model: Any, plan: Any, staleness: int, slack: float,
                 epochs: int, note: Note, warmup: int = WARMUP,
                 late_gradients: str = "reuse") -> None:
        if late_gradients not in ("reuse", "rescale"):
            raise ValueError(f"late_gradients must be reuse or rescale, got {late_gradients!r}")
        comm = plan.comm
        require_tagged(comm, "--adapt adjust+partial")
        self.comm, self.plan, self.note = comm, plan, note
        self.staleness, self.slack, self.epochs, self.warmup = staleness, slack, epochs, warmup
        self.halo = StaleHalo(comm, staleness, self._deadline, self._reached)
        plan.stale = self.halo
        strategy.grad_sync = self._grad_sync
        self.strategy = strategy
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.hops = parameter_hops(model, self.params)
        # (on a shard the in-edges of other parts' vertices are the other workers')
        self.counts = bfs_counts(plan.graph, plan.source.train_mask, plan.book.part_of,
                                 comm.world_size, max(self.hops, default=0),
                                 comm if plan.shard is not None and comm.world_size > 1
                                 else None)
        self.store = store_of(comm) if comm.world_size > 1 else None
        self.prefix = f"fullgraph/partial/{next(_RUNS)}/"
        self.outbox = Outbox()
        self.reuse = late_gradients == "reuse"
        # at the leader: each worker's latest late gradient (epoch, flat), and those in
        # flight (rank, epoch, message)
        self.held: dict[int, tuple[int, Tensor]] = {}
        self.incoming: list[tuple[int, int, Tagged]] = []
        self.reused: list[int] = []  # this epoch's workers whose held gradient was added
        self.reused_age = 0  # the oldest of them, in epochs
        self.samples: dict[Point, collections.deque[float]] = {}
        self.t0: dict[Point, float] = {}
        self.step_samples: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.wait_samples: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.sampled = False  # samples were taken since the baselines were set
        self.t0_step = math.inf
        self.wait0 = 0.0
        self.epoch, self.sync = 0, True
        self.t_step = self.t_prev = 0.0
        self.start: int | None = None  # the first epoch this process runs (a resume)
        self.syncs: list[int] = []

    def header(self) -> list[str]:
        late = ("a left-out worker's latest gradient (up to K epochs old) reused, else "
                "BFS-weighted" if self.reuse else "BFS-weighted")
        if self.staleness == 1:
            return ["partial  adjust+partial (exact with K=1): every worker synchronised on "
                    "every epoch, as without partial reduce"]
        return [f"partial  adjust+partial (approximate): halo rows up to K={self.staleness} "
                f"epochs old past a per-stage deadline of (1 + {self.slack}) x its warm-up "
                f"time; gradients summed over the ready majority, {late}; every worker "
                f"synchronised on the first {self.warmup} epochs, then every {self.staleness} "
                f"epochs and on the last, and accuracy evaluated on those only"] + ([
                    f"partial  resumed after epoch {self.resumed_after}: the deadlines are "
                    f"measured again over the first {self.warmup} epochs run here, every "
                    "worker synchronised until then (a worker still slowed then sets them)"]
                    if self.resumed_after is not None else [])

    def collective_epoch(self, epoch: int) -> bool:
        """True on the full-synchronisation epochs (see the module docstring), counted
        from the first epoch this process runs (the same on every rank, also after a
        resume, which needs a warm-up of its own)."""
        if self.start is None:
            self.start = epoch
        done = epoch - self.start + 1  # epochs run here, this one included
        return (done <= self.warmup or epoch >= self.epochs
                or (done - self.warmup) % self.staleness == 0)

    def _warming(self) -> bool:
        return self.start is not None and self.epoch - self.start < self.warmup

    def _sampling(self) -> bool:
        """Whether this epoch's times feed the baselines: a full synchronisation, not
        the first epoch run here (its times hold one-off costs: allocation, the
        kernels' first calls)."""
        return self.sync and self.start is not None and self.epoch > self.start

    # ------------------------------------------------------------------ hooks
    def before_epoch(self, epoch: int) -> None:
        self.epoch, self.sync = epoch, self.collective_epoch(epoch)
        if not self._warming() and self.sampled:
            self._set_baselines()
        self.halo.begin_epoch(epoch, self.sync)
        if self.sync:  # every worker comes here: the backlog of a straggler is waited for
            start = time.perf_counter()
            self.halo.drain()
            self._take_late(wait=True)
            self.outbox.reap()
            self.halo.stats.blocked_s += time.perf_counter() - start
            self._forget(epoch)
        # the adjuster, run after this epoch, measures it alone; but where the previous
        # epoch was partial its adjustment runs at the start of this one, on that
        # epoch's clock, and empties the clock itself
        deferred = self.sync and not self.collective_epoch(epoch - 1)
        if self.plan.clock is not None and self.collective_epoch(epoch + 1) and not deferred:
            self.plan.clock.take()

    def before_forward(self) -> None:
        self.t_step = self.t_prev = time.perf_counter()

    def _set_baselines(self) -> None:
        self.t0 = {p: usual(v) for p, v in self.samples.items() if v}
        if self.step_samples:
            self.t0_step = usual(self.step_samples)
            self.wait0 = usual(self.wait_samples)
        self.sampled = False

    def _deadline(self, point: Point) -> float:
        base = self.t0.get(point)
        return math.inf if base is None else self.t_prev + (1.0 + self.slack) * base

    def _reached(self, point: Point) -> None:
        now = time.perf_counter()
        if self._sampling():
            self.samples.setdefault(point, collections.deque(maxlen=WINDOW)).append(
                now - self.t_prev)
            self.sampled = True
        self.t_prev = now

    # ------------------------------------------------------- gradient sync
    def _grad_sync(self, model: Any, plan: Any, loss: Tensor) -> float:
        """After the backward pass: the exact sync, or the partial update."""
        ready = time.perf_counter()
        stats = self.halo.stats
        if self.sync:
            self.strategy.sync_grads(model, plan)
            value = self.strategy.reduce_loss(loss, plan)
            blocked = stats.blocked_s + time.perf_counter() - ready
            if self._sampling():
                self.step_samples.append(ready - self.t_step)
                self.wait_samples.append(blocked)
                self.sampled = True
            self.note(self._event(stats, blocked, list(range(self.comm.world_size)), True))
            return value
        members = self._ready_set(ready)
        value = self._reduce(members, loss)
        blocked = stats.blocked_s + time.perf_counter() - ready
        self.note(self._event(stats, blocked, members, False))
        return value

    def _ready_set(self, ready: float) -> list[int]:
        comm, store = self.comm, self.store
        world = comm.world_size
        if store is None:
            return [0]
        base = f"{self.prefix}{self.epoch}/"
        try:
            store.set(f"{base}ready/{comm.rank}", "1")
            store.add(f"{base}count", 1)
        except (RuntimeError, OSError) as err:  # the store's host (rank 0) is gone
            raise CommError(comm.rank, world, PHASE, "ready mark in the store of rank 0",
                            err, 0.0, comm.timeout) from err
        deadline = self.t_step + (1.0 + self.slack) * self.t0_step

        def ready_ranks() -> list[int]:
            return [r for r in range(world)
                    if r == comm.rank or store.check([f"{base}ready/{r}"])]

        def propose() -> str | None:
            self.halo.raise_failures()  # a dead peer is named, not waited for
            self.outbox.reap()
            count = store.add(f"{base}count", 0)
            if count < world and (count < world // 2 + 1 or time.perf_counter() < deadline):
                return None
            ranks = ready_ranks()
            if len(ranks) == world or (time.perf_counter() >= deadline
                                       and len(ranks) >= world // 2 + 1):
                return ",".join(map(str, ranks))
            return None

        def waiting_on() -> str:
            missing = sorted(set(range(world)) - set(ready_ranks()))
            return f"a majority of ranks to be ready at epoch {self.epoch}; not ready: " \
                   f"{', '.join(map(str, missing))}"

        value = agree(store, f"{base}set", propose, comm, PHASE, waiting_on)
        return [int(r) for r in value.split(",")]

    def _reduce(self, members: list[int], loss: Tensor) -> float:
        """Sum the members' gradients at their lowest rank (with the held gradients of
        the others under ``reuse``), scale, send to all."""
        comm, params = self.comm, self.params
        dtype = params[0].dtype if params else torch.float64
        present = [float(p.grad is not None) for p in params]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          .to(dtype) for p in params]
                         + [torch.tensor(present, dtype=dtype),
                            loss.detach().reshape(1).to(dtype)])
        leader = members[0]
        up = TAG_BASE + self.epoch * POINTS_PER_EPOCH + POINTS_PER_EPOCH - 2
        down = up + 1
        late = up - 1
        self.reused, self.reused_age = [], 0
        if comm.rank == leader:
            parts = {comm.rank: flat}
            pending = {m: post_recv(flat.shape, dtype, m, up, comm, PHASE)
                       for m in members if m != comm.rank}
            for m, message in pending.items():
                parts[m] = message.wait()
            covered = list(members)
            if self.reuse:
                left_out = [r for r in range(comm.world_size) if r not in members]
                self._take_late(wait=False)
                for r in left_out:
                    held = self.held.get(r)
                    if held is not None and self.epoch - held[0] <= self.staleness \
                            and held[1].shape == flat.shape:
                        parts[r] = held[1]
                        self.reused.append(r)
                        self.reused_age = max(self.reused_age, self.epoch - held[0])
                covered = sorted(members + self.reused)
                for r in left_out:  # its gradient of this epoch, whenever it comes
                    self.incoming.append((r, self.epoch, post_recv(flat.shape, dtype, r, late,
                                                                   comm, PHASE)))
            result = self._scaled(sum_in_order([parts[m] for m in covered]), covered)
            for r in range(comm.world_size):
                if r != comm.rank:
                    self.outbox.add(post_send(result, r, down, comm, PHASE))
        else:
            if comm.rank in members:
                self.outbox.add(post_send(flat, leader, up, comm, PHASE))
            result = post_recv(flat.shape, dtype, leader, down, comm, PHASE).wait()
            if self.reuse and comm.rank not in members:
                self.outbox.add(post_send(flat, leader, late, comm, PHASE))
        flags = result[-1 - len(params):-1]
        offset = 0
        for p, flag in zip(params, flags.tolist()):
            n = p.numel()  # as the exact sync: None where no member had a gradient
            p.grad = result[offset:offset + n].view_as(p).to(p.dtype).clone() if flag else None
            offset += n
        return float(result[-1])

    def _take_late(self, wait: bool) -> None:
        """Move the late gradients that arrived (``wait``: all of them, each within the
        timeout) into ``held``, keeping each worker's latest; forget held ones too old
        to be used again."""
        still = []
        for rank, epoch, message in self.incoming:
            if wait:
                message.wait()
            if message.done():
                if rank not in self.held or self.held[rank][0] < epoch:
                    self.held[rank] = (epoch, message.buffer)
            else:
                still.append((rank, epoch, message))
        self.incoming = still
        self.held = {r: (e, g) for r, (e, g) in self.held.items()
                     if self.epoch - e <= self.staleness}

    def _scaled(self, total: Tensor, members: Sequence[int]) -> Tensor:
        """Formula 14 on sums: each parameter's sum times N^(h) / N_S^(h); the loss
        times N^(0) / N_S^(0) (the training vertices)."""
        factors = coverage_factors(self.counts, members)
        out = total.clone()
        offset = 0
        for p, h in zip(self.params, self.hops):
            n = p.numel()
            out[offset:offset + n] *= factors[h]
            offset += n
        out[-1] *= factors[0]
        return out

    def _event(self, stats: EpochStats, blocked: float, members: list[int],
               sync: bool) -> dict[str, Any]:
        world = self.comm.world_size
        return {"kind": "partial", "sync": sync, "ready": members,
                "skipped": sorted(set(range(world)) - set(members)),
                "reused": [] if sync else list(self.reused),
                "reused_age": 0 if sync else self.reused_age,
                "stale_peers": stats.stale_peers, "stale_rows": stats.stale_rows,
                "oldest": stats.oldest, "forced_waits": stats.forced_waits,
                "late_refreshes": stats.late_refreshes, "blocked_s": blocked,
                "slack_s": self.slack * self.t0_step if math.isfinite(self.t0_step) else None,
                "baseline_wait_s": self.wait0}

    def _forget(self, epoch: int) -> None:
        """Delete the store keys of the epochs before the previous full
        synchronisation (every rank has read them: it passed that one)."""
        if self.store is not None and self.comm.rank == 0 and self.syncs:
            for old in range(self.syncs[0], self.syncs[-1]):
                for key in [f"ready/{r}" for r in range(self.comm.world_size)] + \
                        ["count", "set"]:
                    try:
                        self.store.delete_key(f"{self.prefix}{old}/{key}")
                    except (RuntimeError, AttributeError):  # a store without deletion
                        return
        self.syncs = (self.syncs + [epoch])[-2:]

    def close(self) -> None:
        self.halo.close()
        self._take_late(wait=True)
        self.outbox.flush()

    def abort(self) -> None:
        """On an error: let go of every message without waiting (the error stands)."""
        self.halo.outbox.pending.clear()
        self.halo.pending.clear()
        self.outbox.pending.clear()
        self.incoming.clear()


def sum_in_order(parts: list[Tensor]) -> Tensor:
    """The sum of ``parts`` left to right (the same on every run)."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def coverage_factors(counts: np.ndarray, members: Sequence[int]) -> list[float]:
    """Per hop h: N^(h) / N_S^(h) (1 where the members hold no such vertex)."""
    total = counts.sum(axis=0)
    covered = counts[list(members)].sum(axis=0)
    return [float(t) / float(c) if c else 1.0 for t, c in zip(total, covered)]


def parameter_hops(model: Any, params: list[Tensor]) -> list[int]:
    """Per parameter: the number of propagate stages at or after its stage (0 for a
    parameter outside the stages)."""
    infos = describe(model)
    after = [sum(1 for info in infos[s:] if info.is_propagate) for s in range(len(infos))]
    where: dict[int, int] = {}
    for s, stage in enumerate(model.stages):
        for p in stage.parameters():
            where.setdefault(id(p), after[s])
    return [where.get(id(p), 0) for p in params]


def bfs_counts(graph: Any, train_mask: Tensor, part_of: Tensor, world: int,
               max_hops: int, comm: Comm | None = None) -> np.ndarray:
    """(world, max_hops + 1): per worker k and hop h, n_k^(h), the vertices worker k
    owns within h in-edge hops of the training vertices (a backward BFS, §5.3).

    With ``comm`` (collective: a per-part shard, whose ``graph`` holds the in-edges of
    its own vertices but not all of the others'), each worker follows the in-edges of
    the frontier vertices it owns and the vertices reached are combined over the
    workers at every hop, which gives the counts of the whole graph on every worker."""
    reached = train_mask.numpy().astype(bool).copy()
    owner = part_of.numpy()
    counts = np.zeros((world, max_hops + 1), dtype=np.int64)
    frontier = np.flatnonzero(reached)
    for h in range(max_hops + 1):
        counts[:, h] = np.bincount(owner[reached], minlength=world)[:world]
        if h == max_hops or frontier.size == 0:  # (the same on every worker)
            continue
        if comm is not None:
            frontier = frontier[owner[frontier] == comm.rank]
        _, src, _ = in_edges(graph, frontier.astype(np.int64))
        if comm is not None:
            hit = torch.zeros(reached.size, dtype=torch.uint8)
            hit[torch.from_numpy(src.astype(np.int64))] = 1
            src = np.flatnonzero(prim.all_reduce_(hit, comm, PHASE, op="max").numpy())
        src = np.unique(src)
        frontier = src[~reached[src]]
        reached[frontier] = True
    return counts
