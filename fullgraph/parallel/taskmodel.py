"""The task scheduling model of NeutronTask (§5.2, formulas 5-8): how many workers
run the transform (T / E) stages and how many the propagate (P) stages.

    T_t = (sum over T stages 2 |V| |W| + sum over E stages 2 |E| d_in) / FLOPS         (5)
    T_p = sum over P stages  gamma 2 |V| dbar d / FLOPS
                       + (1 - gamma) (|V| dbar (1 + 2 d) + |V|) s / bandwidth          (6)
    N_p = N T_p / (T_p + T_t),  N_t = N - N_p                                          (7, 8)

``|V|``, ``|E|`` and ``dbar`` (the average in-degree) come from the graph, the
dimensions from the stage program (``|W|``: a T stage's weight-matrix entries,
d_in x d_out for a dense layer; dropout and activation stages cost no GEMM),
``s`` is the bytes per value, and FLOPS and bandwidth are measured on this machine
at start (``measure_machine``: a dense GEMM and a large copy, timed on rank 0 and
broadcast so every worker decides the same).
``gamma`` is how much of a propagation's memory traffic overlaps its arithmetic.
The split is rounded to whole workers, each group keeping at least one.

Everything except ``measure_machine`` is a pure function, tested without processes.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fullgraph.comm import primitives as prim
from fullgraph.comm.group import Comm
from fullgraph.models.stages import StageProgram
from fullgraph.models.walk import describe


@dataclass(frozen=True)
class Machine:
    """Measured (or given) rates: ``flops`` per second of a dense GEMM, ``bandwidth``
    bytes per second of a large copy (read + write)."""

    flops: float
    bandwidth: float

    def describe(self) -> str:
        return f"GEMM {self.flops / 1e9:.1f} GFLOP/s, memory {self.bandwidth / 1e9:.1f} GB/s"


@dataclass(frozen=True)
class TaskSplit:
    """Workers per group and the model's predictions for one epoch's forward.

    Attributes:
        num_t, num_p: workers of the T group (ranks ``0..num_t-1``) and of the P group.
        predicted_t, predicted_p: formula 5 and 6, seconds on one worker (None when
            the split was given by hand and nothing was measured).
        how: ``auto`` or ``given``.
    """

    num_t: int
    num_p: int
    predicted_t: float | None = None
    predicted_p: float | None = None
    how: str = "given"

    @property
    def t_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.num_t))

    @property
    def p_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.num_t, self.num_t + self.num_p))


def split_counts(text: str) -> tuple[int, int] | None:
    """``"auto"`` -> None; ``"T:P"`` -> the two worker counts (each at least 1)."""
    if text == "auto":
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f"task split {text!r}: expected 'auto' or T:P worker counts, e.g. 1:3")
    num_t, num_p = int(match.group(1)), int(match.group(2))
    if num_t < 1 or num_p < 1:
        raise ValueError(f"task split {text!r}: each group needs at least one worker")
    return num_t, num_p


def parse_split(text: str, world_size: int) -> TaskSplit | None:
    """``"auto"`` -> None; ``"T:P"`` -> the split, checked against ``world_size``."""
    counts = split_counts(text)
    if counts is None:
        return None
    num_t, num_p = counts
    if num_t + num_p != world_size:
        raise ValueError(f"task split {text!r} needs {num_t + num_p} workers, the run has "
                         f"{world_size}")
    return TaskSplit(num_t, num_p)


def predict_times(program: StageProgram, num_vertices: int, num_edges: int, machine: Machine,
                  gamma: float, itemsize: int = 4) -> tuple[float, float]:
    """(T_t, T_p) of formulas 5 and 6: one forward pass on one worker, in seconds."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    v, e = float(num_vertices), float(num_edges)
    dbar = e / max(1.0, v)
    t_flop = p_time = 0.0
    for info, stage in zip(describe(program), program.stages):
        d_in = int(stage.in_dim)
        if info.is_transform:
            t_flop += 2 * v * sum(p.numel() for p in stage.parameters() if p.dim() == 2)
        elif info.is_edge:
            t_flop += 2 * e * d_in
        else:
            compute = 2 * v * dbar * d_in / machine.flops
            memory = (v * dbar * (1 + 2 * d_in) + v) * itemsize / machine.bandwidth
            p_time += gamma * compute + (1 - gamma) * memory
    return t_flop / machine.flops, p_time


def choose_split(world_size: int, t_time: float, p_time: float,
                 fits: Callable[[int], bool] | None = None) -> TaskSplit:
    """Formulas 7 and 8, rounded to whole workers with at least one per group: of the
    P group sizes that ``fits`` (default: all), the nearest to the formulas' share.

    Raises:
        ValueError: fewer than 2 workers, or no P group size fits.
    """
    if world_size < 2:
        raise ValueError(f"task parallelism needs at least 2 workers, got {world_size}")
    total = t_time + p_time
    share = p_time / total if total > 0 else 0.5
    ideal = min(world_size - 1, max(1, round(world_size * share)))
    sizes = [n for n in range(1, world_size) if fits is None or fits(n)]
    if not sizes:
        raise ValueError(f"no P group of 1 to {world_size - 1} workers fits the options")
    num_p = min(sizes, key=lambda n: (abs(n - ideal), n))
    return TaskSplit(world_size - num_p, num_p, t_time, p_time, "auto")


def measure_machine(comm: Comm, size: int = 512, copy_mib: int = 64,
                    device: torch.device | str = "cpu") -> Machine:
    """GEMM rate and copy bandwidth measured on rank 0 and broadcast (collective), on
    ``device``, where the workers compute (a GPU's rates are not its host's). On a GPU
    the GEMM is 4x ``size`` on a side, a size the device is not idle for."""
    rates = torch.zeros(2, dtype=torch.float64)
    device = torch.device(device)
    if comm.rank == 0:
        cuda = device.type == "cuda"
        size = 4 * size if cuda else size

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(device)

        a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
        src = torch.empty(copy_mib * 2**18, device=device)  # float32: copy_mib MiB
        dst = torch.empty_like(src)
        best_gemm = best_copy = float("inf")
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            a @ b
            sync()
            t1 = time.perf_counter()
            dst.copy_(src)
            sync()
            t2 = time.perf_counter()
            best_gemm, best_copy = min(best_gemm, t1 - t0), min(best_copy, t2 - t1)
        rates[0] = 2 * size**3 / max(best_gemm, 1e-9)
        rates[1] = 2 * src.numel() * src.element_size() / max(best_copy, 1e-9)
    if comm.world_size > 1:
        prim.broadcast_(rates, 0, comm, "setup")
    return Machine(float(rates[0]), float(rates[1]))
