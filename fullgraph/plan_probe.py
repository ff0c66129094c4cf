"""Each candidate's fixed cost per epoch at the real worker count (``fullgraph plan``).

What an epoch costs beyond its graph work -- the interpreter and autograd, the
executor's own bookkeeping, every collective round, and the scheduling of workers
that share cores -- depends on the worker count and on how the workers share this
machine, not on the graph. The planner measures it here as it will be paid: the
workers are launched as ``fullgraph train`` launches them, and every candidate trains
a few epochs of the user's model on a ring of a few vertices per worker
(``plan_measure.tiny_dataset``), in rounds; rank 0 writes each candidate's median
epoch (each epoch the slowest worker's) to a JSON file. Then all workers run the
same fixed workload at once (``plan_measure.workload_seconds``): against the
planner's own timing of it alone, how much the workers slow each other down. Last,
the workers time all-to-alls of one row and of ``LINK_BYTES`` per worker through the
real communicator: what a received byte costs with the backend's copies, packing and
scheduling (``link_seconds``). On our 2-core machine a raw socket between two
processes (``plan_measure.measure_link``) read 1.5 to 5 times cheaper than that.

    python -m fullgraph.plan_probe OUT.json CONFIG.json LABEL [LABEL ...]   # per worker
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

EPOCHS = 6
"""Epochs per run of a candidate; the first is left out of the median."""
ROUNDS = 3
"""Runs per candidate, every candidate once per round."""
RING_PER_WORKER = 32
"""Vertices of the probe's ring per worker."""
LINK_BYTES = 4 << 20
"""Bytes each worker receives in the probe's timed all-to-alls (``link_seconds``)."""


def probe_config(cfg: Any, cand: Any) -> Any:
    """``cfg`` running ``cand`` for a probe: a few epochs, no outputs, no adaptation,
    no saved partition (it belongs to the real graph), task chunk and subgraph counts
    the ring can hold."""
    from fullgraph.config import AdaptConfig
    from fullgraph.plan_measure import candidate_config

    cfg = candidate_config(cfg, cand)
    train = dataclasses.replace(cfg.train, epochs=EPOCHS, metrics_out=None, checkpoint_dir=None,
                                resume=None, save_model=None, progress="off", eval_every=1)
    options = dict(cfg.options)
    options["partition"] = dataclasses.replace(options["partition"], file=None)
    task = options["task_parallel"]  # the ring has RING_PER_WORKER vertices per worker
    options["task_parallel"] = dataclasses.replace(
        task, chunks=min(task.chunks, RING_PER_WORKER),
        subgraphs=min(task.subgraphs, RING_PER_WORKER))
    return dataclasses.replace(cfg, train=train, adapt=AdaptConfig(), options=options)


def measure(cfg: Any, labels: list[str], features: int, classes: int,
            comm: Any) -> tuple[dict[str, float], int]:
    """Per candidate label, the median epoch (seconds) on the probe ring with
    ``comm``'s workers, each epoch the slowest worker's (the epoch as the benchmarks
    read ``fullgraph train``'s metrics): over ``ROUNDS`` rounds that train every
    candidate in turn, the epochs after each run's first pooled, so that a stretch of
    load on the machine falls on one run of several candidates rather than on every
    epoch of one (a single run moved 2x between probes of the same candidate).

    Also the largest peak resident size of the workers after their first run: that of
    a worker that has trained one strategy (on the ring), as a real run's worker does
    before its data; the later runs leave kernels and freed memory of their own.
    """
    import torch

    from fullgraph import plan as P
    from fullgraph.comm.group import env_int
    from fullgraph.comm.primitives import all_gather_object
    from fullgraph.plan_measure import tiny_dataset
    from fullgraph.profile import peak_memory_bytes
    from fullgraph.train import train

    cands = {c.label: c for c in P.CANDIDATES}
    epochs: dict[str, list[float]] = {label: [] for label in labels}
    peak = 0
    for _ in range(ROUNDS):
        for label in labels:
            torch.random.default_generator.manual_seed(0)  # every worker, the same ring
            dataset = tiny_dataset(features, classes, RING_PER_WORKER * comm.world_size)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = train(dataset, probe_config(cfg, cands[label]), comm=comm,
                               local_rank=env_int("LOCAL_RANK", 0))
            mine = [r.epoch_s for r in result.epochs[1:]]
            epochs[label] += [max(walls) for walls in
                              zip(*all_gather_object(mine, comm, "probe"))]
            if not peak:
                peak = max(all_gather_object(peak_memory_bytes(torch.device("cpu")), comm,
                                             "probe"))
    return {label: statistics.median(walls) for label, walls in epochs.items()}, peak


def link_seconds(comm: Any, nbytes: int = LINK_BYTES, trips: int = 5) -> float:
    """Seconds per byte received in an all-to-all over ``comm`` (the slowest worker):
    the least of ``trips`` all-to-alls receiving ``nbytes`` in all, less the least of
    ``trips`` receiving one row, over the bytes."""
    import time

    import torch

    from fullgraph.comm.primitives import all_gather_object, all_to_all_v, barrier

    peers = comm.world_size - 1
    width = 256

    def best(rows: int) -> float:
        send = [torch.ones(rows if p != comm.rank else 0, width) for p in range(comm.world_size)]
        recv = [rows if p != comm.rank else 0 for p in range(comm.world_size)]
        times = []
        for _ in range(trips + 1):  # the first is a warm-up
            barrier(comm, "probe")
            t0 = time.perf_counter()
            all_to_all_v(send, recv, comm, "probe")
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    rows = max(1, nbytes // (4 * width * peers))
    per_byte = max(0.0, best(rows) - best(1)) / (4 * width * rows * peers)
    return float(max(all_gather_object(per_byte, comm, "probe")))


PROBE_TIMEOUT_S = 120.0
"""The most ``--timeout`` the probe's workers get: their work (a ring of a few vertices
per worker) takes seconds, start-up included."""


def main(argv: list[str]) -> int:
    from fullgraph import launch
    from fullgraph.comm.group import destroy_comm, env_int, init_comm, resolve_device
    from fullgraph.comm.primitives import all_gather_object, barrier
    from fullgraph.config import config_from_dict
    from fullgraph.plan_measure import workload_seconds

    out_path, config_path, *labels = argv
    spec = json.loads(Path(config_path).read_text())

    def body(status: Any) -> int:
        with warnings.catch_warnings():  # the planner's process said them already
            warnings.simplefilter("ignore")
            cfg = config_from_dict(spec["config"], config_path)  # (a failure is reported)
        backend = None if cfg.launch.backend == "auto" else cfg.launch.backend
        device = resolve_device(cfg.train.device, env_int("LOCAL_RANK", 0))
        comm = init_comm(backend=backend, timeout_s=cfg.launch.timeout_s, device=device)
        status.watch(comm.counter)
        try:
            status.set_phase(f"the probe's epochs of {', '.join(labels)}")
            times, peak = measure(cfg, labels, spec["features"], spec["classes"], comm)
            status.set_phase("the probe's shared workload")
            barrier(comm, "probe")  # every worker at once
            concurrent = max(all_gather_object(workload_seconds(), comm, "probe"))
            status.set_phase("the probe's link timing")
            per_byte = link_seconds(comm)
        finally:
            destroy_comm(comm)
        if comm.rank == 0:
            Path(out_path).write_text(json.dumps({"fixed": times, "workload": concurrent,
                                                  "byte": per_byte, "peak": peak}))
        return 0

    return launch.run_worker(body)


@dataclasses.dataclass(frozen=True)
class Probe:
    """What the probe's workers measured.

    Attributes:
        fixed: per candidate label, seconds per epoch on the ring.
        workload: seconds of ``plan_measure.workload_seconds`` on the slowest worker,
            all workers running it at once.
        byte: seconds per byte received in an all-to-all (``link_seconds``; 0: not
            measured).
        peak: the largest peak resident size of the probe's workers, in bytes (0: not
            measured).
    """

    fixed: dict[str, float]
    workload: float
    byte: float = 0.0
    peak: int = 0


def probe(cfg: Any, labels: list[str], features: int, classes: int) -> Probe:
    """Launch ``cfg.launch.workers`` local workers and measure, per candidate label, its
    fixed seconds per epoch at that worker count, then the shared workload on all of
    them at once (see the module docstring).

    Raises:
        RuntimeError: the probe's workers failed (their message is printed by the
            launcher).
    """
    from fullgraph import launch
    from fullgraph.models.custom import for_workers

    # its work takes seconds: a hung worker is given up on sooner than a run's would be
    timeout = min(cfg.launch.timeout_s, PROBE_TIMEOUT_S)
    tree = cfg.to_dict()
    tree["launch"]["timeout_s"] = timeout
    with tempfile.TemporaryDirectory(prefix="fullgraph-plan-probe-") as tmp, \
            launch.environment(for_workers(cfg.model.name)):  # the model's module, as here
        out, spec = Path(tmp) / "times.json", Path(tmp) / "config.json"
        spec.write_text(json.dumps({"config": tree, "features": features,
                                    "classes": classes}))
        code = launch.launch_local([str(out), str(spec), *labels], cfg.launch.workers,
                                   timeout_s=timeout, run_dir=None,
                                   threads=cfg.runtime.threads,
                                   module="fullgraph.plan_probe")
        if code != 0 or not out.exists():
            raise RuntimeError(f"the planner's probe workers failed (exit {code})")
        got = json.loads(out.read_text())
        return Probe({k: float(v) for k, v in got["fixed"].items()}, float(got["workload"]),
                      float(got["byte"]), int(got.get("peak", 0)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
