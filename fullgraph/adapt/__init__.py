"""The resource-aware runtime (NeutronCloud): adapters ``train`` calls every epoch.

``build_adapters`` turns the ``adapt`` config section into this worker's adapters:
- ``--inject``: seeded slowdowns of chosen workers (``inject``, ``injector``);
- ``--adapt adjust``: online DepCache / DepComm adjustment of data parallelism
  (``adjuster``), or rows and columns of tensor parallelism in proportion to measured
  speed (``shares``); both exact: training equals the single-process executor;
- ``--adapt adjust+partial``: adjustment plus partial reduce (``partial``), the
  approximate mode: stale halo rows past a deadline and gradient sync among the ready
  majority, every worker synchronised every ``--staleness`` epochs.
"""
from __future__ import annotations

import warnings
from typing import Any

from fullgraph.adapt.base import Adapter, Note
from fullgraph.errors import ConfigError

ADJUSTABLE = ("data", "tensor")
"""Strategies ``--adapt adjust`` works on."""


UNUSED_CACHE_BUDGET = ("--cache-budget bounds DepCache under --adapt adjust with --strategy "
                       "data; it has no effect here")


def check_options(cfg: Any, world: int) -> None:
    """Refuse ``adapt`` options the run cannot honour (before any worker starts):
    ``check_general``, then ``check_strategy``.

    Raises:
        ConfigError: as those do.
    """
    check_general(cfg, world)
    check_strategy(cfg)


def check_general(cfg: Any, world: int) -> None:
    """Refuse ``adapt`` options that no strategy could honour: a cache budget without
    adjustment, or an injection item naming a missing rank or an epoch past the last.

    Raises:
        ConfigError: naming the option.
    """
    from fullgraph.adapt.inject import check_world, parse

    opts = cfg.adapt
    if opts.cache_budget_mb is not None and opts.mode == "off":
        raise ConfigError(UNUSED_CACHE_BUDGET)
    if opts.inject:
        try:
            specs = parse(opts.inject)
            check_world(specs, world, cfg.train.epochs)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        long = [s for s in specs if s.seconds is not None and s.seconds >= cfg.launch.timeout_s]
        if long and world > 1:
            raise ConfigError(f"--inject {long[0].kind}: s={long[0].seconds:g} is at least "
                              f"--timeout ({cfg.launch.timeout_s:g} s): the other workers "
                              "would stop, taking the slowed one for hung; give a shorter "
                              "sleep or a longer --timeout")


def check_local_launch(cfg: Any) -> None:
    """Refuse what workers the local launcher starts on this host cannot honour: a
    ``net`` slowdown, which shapes a worker's own network interface (they share this
    host's).

    Raises:
        ConfigError: naming the option.
    """
    from fullgraph.adapt.inject import parse

    if cfg.adapt.inject and any(s.kind == "net" for s in parse(cfg.adapt.inject)):
        raise ConfigError("--inject net: shapes a worker's own network interface, and the "
                          "workers --workers N starts share this host's; start one process "
                          "per rank (torchrun), each with GLOO_SOCKET_IFNAME naming its own "
                          "interface, as `python -m fullgraph.bench.cloud --link 1gbit` does")


def check_strategy(cfg: Any) -> None:
    """Refuse ``adapt`` options that the run's strategy (or backend, or model) does not
    take: partial reduce off data parallelism, on NCCL or with batch normalisation;
    adjustment off data and tensor parallelism; a cache budget off data parallelism.

    Raises:
        ConfigError: naming the option and the strategy.
    """
    opts, strategy = cfg.adapt, cfg.runtime.strategy
    if opts.mode == "adjust+partial":
        if strategy != "data":
            raise ConfigError(f"--adapt adjust+partial (partial reduce) works on --strategy "
                              f"data; the run uses {strategy!r}")
        if cfg.launch.backend == "nccl" or cfg.train.on_gpu:
            raise ConfigError("--adapt adjust+partial matches its messages by tag, which "
                              "needs the gloo backend (CPU); NCCL matches by order")
        if cfg.model.batch_norm:
            raise ConfigError("--adapt adjust+partial: batch normalisation sums over every "
                              "worker's rows in the forward pass, a collective a straggler "
                              "would block; train without --batch-norm")
    if opts.mode == "adjust" and strategy not in ADJUSTABLE:
        raise ConfigError(f"--adapt adjust works on --strategy data (DepCache/DepComm) or "
                          f"tensor (speed-proportional shares); the run uses {strategy!r}")
    if opts.cache_budget_mb is not None and strategy != "data":
        raise ConfigError(UNUSED_CACHE_BUDGET)


def build_adapters(cfg: Any, strategy: Any, model: Any, plan: Any, rank: int, world: int,
                   note: Note) -> list[Adapter]:
    """This worker's adapters for ``cfg.adapt`` (collective when adjusting)."""
    from fullgraph.adapt.inject import parse

    check_options(cfg, world)
    opts = cfg.adapt
    adapters: list[Adapter] = []
    if opts.inject:
        from fullgraph.adapt.injector import Injector

        try:
            adapters.append(Injector(parse(opts.inject), rank, cfg.train.epochs, note, world))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if world == 1:  # here, once: check_options runs before a launch as well
        if opts.mode != "off":
            warnings.warn(f"--adapt {opts.mode} has no effect with one worker: there is no "
                          "other worker to move work to", stacklevel=2)
        return adapters
    if opts.mode == "adjust+partial":
        from fullgraph.adapt.partial import PartialReduce

        if world == 2 and rank == 0:
            warnings.warn("--adapt adjust+partial on 2 workers: an update waits for a "
                          "majority (M // 2 + 1), which is both, so no worker is left out "
                          "of one; only the partial computation (stale halo rows) takes "
                          "effect. 3 or more workers let it leave a straggler out",
                          stacklevel=2)

        # first, so that its step clock starts before any injected delay
        adapters.insert(0, PartialReduce(strategy, model, plan, opts.staleness, opts.slack,
                                         cfg.train.epochs, note,
                                         late_gradients=opts.late_gradients))
    if opts.mode != "off":
        adapters.append(_adjuster(cfg, strategy, model, plan, note))
    return adapters


def _adjuster(cfg: Any, strategy: Any, model: Any, plan: Any, note: Note) -> Adapter:
    """``--adapt adjust``: DepCache/DepComm for data, speed-proportional shares for tensor."""
    from fullgraph.parallel.data import DataParallel
    from fullgraph.parallel.tensor import TensorParallel

    opts = cfg.adapt
    if isinstance(strategy, TensorParallel):
        from fullgraph.adapt.shares import ShareBalancer

        return ShareBalancer(strategy, plan, note)
    if not isinstance(strategy, DataParallel):
        raise ConfigError(f"--adapt adjust works on --strategy data (DepCache/DepComm) or "
                          f"tensor (speed-proportional shares); the run uses "
                          f"{cfg.runtime.strategy!r}")
    from fullgraph.adapt.adjuster import OnlineAdjuster

    budget = None if opts.cache_budget_mb is None else opts.cache_budget_mb * 2**20
    adjuster = OnlineAdjuster(strategy, model, plan, budget, note,
                              partial=opts.mode == "adjust+partial")
    adjuster.approximate = adjuster.partial and opts.staleness > 1  # (K=1 is exact)
    return adjuster


__all__ = ["ADJUSTABLE", "Adapter", "build_adapters", "check_general", "check_options",
           "check_strategy"]
