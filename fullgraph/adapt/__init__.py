"""The resource-aware runtime (NeutronCloud): adapters ``train`` calls every epoch.

``build_adapters`` turns the ``adapt`` config section into this worker's adapters:
- ``--inject``: seeded slowdowns of chosen workers (``inject``, ``injector``);
- ``--adapt adjust``: online DepCache / DepComm adjustment of data parallelism
  (``adjuster``; exact: training equals the single-process executor).
"""
from __future__ import annotations

from typing import Any

from fullgraph.adapt.base import Adapter, Note
from fullgraph.errors import ConfigError


def build_adapters(cfg: Any, strategy: Any, model: Any, plan: Any, rank: int, world: int,
                   note: Note) -> list[Adapter]:
    """This worker's adapters for ``cfg.adapt`` (collective when adjusting)."""
    from fullgraph.adapt.inject import check_world, parse

    opts = cfg.adapt
    adapters: list[Adapter] = []
    if opts.inject:
        from fullgraph.adapt.injector import Injector

        specs = parse(opts.inject)
        try:
            check_world(specs, world)
            adapters.append(Injector(specs, rank, cfg.train.epochs, note))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if opts.mode == "adjust":
        from fullgraph.adapt.adjuster import OnlineAdjuster
        from fullgraph.parallel.data import DataParallel

        if not isinstance(strategy, DataParallel):
            raise ConfigError(f"--adapt adjust works on --strategy data (DepCache/DepComm); "
                              f"the run uses {cfg.runtime.strategy!r}")
        budget = None if opts.cache_budget_mb is None else opts.cache_budget_mb * 2**20
        adapters.append(OnlineAdjuster(strategy, model, plan, budget, note))
    return adapters


__all__ = ["Adapter", "build_adapters"]
