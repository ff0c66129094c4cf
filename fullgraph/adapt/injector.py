"""The adapter that applies ``--inject`` slowdowns to this worker (see ``inject``)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fullgraph.adapt.base import Adapter, Note
from fullgraph.adapt.inject import (
    InjectSpec,
    LinkShaper,
    Throttle,
    core_for,
    link_device,
    schedule,
)


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward first sleeps: delays every exchange of the backward pass."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class Injector(Adapter):
    """Sleeps and CPU throttles of one worker, on the schedule of its specs.

    Args:
        specs: the parsed ``--inject`` items.
        rank: this worker's rank.
        epochs: the run's epochs.
        note: where events go (``Profiler.note``).
    """

    local_between = True
    """``between_epochs`` communicates nothing: called after every epoch, also under
    partial reduce."""

    def __init__(self, specs: list[InjectSpec], rank: int, epochs: int, note: Note,
                 world: int = 1) -> None:
        self.specs, self.rank, self.note = specs, rank, note
        self.events = [(spec, first, last) for spec in specs
                       for first, last in schedule(spec, rank, epochs)]
        # epochs in which no worker is slowed (every worker's schedule is known here):
        # only their walls set s=auto, or one worker's slowdown would lengthen the
        # others' "clean" epochs and every later sleep would grow
        self.anyone = {e for spec in specs for r in range(world)
                       for first, last in schedule(spec, r, epochs)
                       for e in range(first, last + 1)}
        self.clean = True
        # only where this worker has such a slowdown: a link to shape needs root and an
        # interface of its own, which the other workers need not have
        kinds = {spec.kind for spec, _, _ in self.events}
        self.throttle = Throttle(core_for(rank)) if "cpu" in kinds else None
        self.shaper = LinkShaper(link_device()) if "net" in kinds else None
        self.sleep_s = 0.0
        self.injected = False
        self.clean_walls: list[float] = []
        self.first: tuple[int, float] | None = None  # the first epoch run here, its wall

    def header(self) -> list[str]:
        return [f"inject   {spec.describe()}" for spec in self.specs]

    def before_epoch(self, epoch: int) -> None:
        sleep, load, net = 0.0, 0, None
        for spec, first, last in self.events:
            if not first <= epoch <= last:
                continue
            if spec.kind == "net":
                net = spec
                self.note({"kind": "inject", "what": "net", "rate": spec.rate,
                           "delay": spec.delay, "first": first, "last": last})
            elif spec.kind == "sleep":
                seconds = spec.seconds if spec.seconds is not None else self._auto_seconds()
                sleep += seconds
                self.note({"kind": "inject", "what": "sleep", "seconds": seconds,
                           "first": first, "last": last})
            else:
                load = max(load, spec.load)
                self.note({"kind": "inject", "what": "cpu", "load": spec.load,
                           "first": first, "last": last})
        self.sleep_s, self.injected = sleep, bool(sleep or load or net)
        self.clean = not self.injected and epoch not in self.anyone
        if self.shaper is not None:
            if net is None:
                self.shaper.stop()
            else:
                self.shaper.start(net.rate, net.delay)
        if self.throttle is not None:
            if self.throttle.active and self.throttle.load != load:
                self.throttle.stop()
            if load:
                self.throttle.start(load)

    def resumed(self, records: Sequence[Any]) -> None:
        """``s=auto`` after a resume: the restored epochs without a slowdown count as
        clean epochs measured here (their times are rank 0's, which synchronous
        training keeps close to every worker's)."""
        super().resumed(records)
        self.clean_walls = [r.epoch_s for r in records if r.epoch not in self.anyone] \
            + self.clean_walls

    def _auto_seconds(self) -> float:
        """Twice the mean clean epoch; the first epoch run here counts only while it
        is the only one (its time holds one-off costs: on Cora 10x a later epoch's)."""
        walls = self.clean_walls or ([self.first[1]] if self.first is not None else [])
        return 2.0 * sum(walls) / len(walls) if walls else 0.0

    def before_forward(self) -> None:
        if self.sleep_s:
            time.sleep(self.sleep_s / 2)

    def on_loss(self, loss: Tensor) -> Tensor:
        if not self.sleep_s:
            return loss
        return _SleepInBackward.apply(loss, self.sleep_s / 2)

    def between_epochs(self, model: Any, plan: Any, epoch: int, profile: Any) -> None:
        if self.first is None:
            self.first = (epoch, profile.wall_s)
        elif self.clean:
            self.clean_walls.append(profile.wall_s)

    def close(self) -> None:
        if self.throttle is not None:
            self.throttle.stop()
        if self.shaper is not None:
            self.shaper.stop()
