"""The interface ``train`` drives runtime adapters through.

An adapter is called on every worker at fixed points of each epoch:
``before_epoch`` (before the training step), ``before_forward`` and ``on_loss``
(inside the step, through the strategy's ``step_hooks``), ``between_epochs`` (after
the epoch's metrics, with this worker's profile, waiting split from transfer), and
``close`` once at the end, also on errors. What an adapter does or sees goes to the
profile through ``note`` (an ``EpochProfile.events`` entry of the next epoch that
ends), so a report can show cause and effect.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

Note = Callable[[dict[str, Any]], None]


class Adapter:
    """Base class: every hook does nothing."""

    resumed_after: int | None = None
    """The last epoch the checkpoint this run resumed from holds (``resumed``)."""

    def header(self) -> list[str]:
        """Run header lines describing what this adapter does."""
        return []

    def resumed(self, records: Sequence[Any]) -> None:
        """Called once before the first epoch of a resumed run with the ``EpochRecord``
        of every epoch before it (the checkpoint's, as rank 0 measured them); sets
        ``resumed_after``."""
        self.resumed_after = records[-1].epoch if records else None

    def before_epoch(self, epoch: int) -> None:
        """Called before the training step of ``epoch``."""

    def before_forward(self) -> None:
        """Called inside the training step, before the forward pass."""

    def on_loss(self, loss: Tensor) -> Tensor:
        """Called with the local loss before the backward pass; returns the loss to
        differentiate (the same value)."""
        return loss

    def between_epochs(self, model: Any, plan: Any, epoch: int, profile: Any) -> None:
        """Called after epoch ``epoch`` (not after the last) with this worker's profile."""

    def close(self) -> None:
        """Called once when training ends, normally or not."""


def resumed_line(adapter: Adapter, start: str) -> list[str]:
    """The header line of an adjusting adapter in a resumed run: the checkpoint holds
    the parameters, not the adjusted plan, so it starts again from ``start``."""
    if adapter.resumed_after is None:
        return []
    return [f"adapt    resumed after epoch {adapter.resumed_after}: from {start}, not the "
            "plan adjusted by then (a checkpoint holds no plan)"]
