"""Training beyond RAM: one worker, with and without the spill, under a memory limit
(a script, not a test).

On a dataset (what ``fullgraph train --dataset`` takes: e.g. the folder of ``fullgraph
generate rmat --vertices 20000000 --edges 400000000 --features 128 --classes 47
--self-loops add``, its ``processed`` folder, or a name under ``--root``), it trains a
decoupled GCN with tensor parallelism on one worker, the dense layers in row blocks
(``--row-block``), once with the propagation's (N, C) matrices in memory and once
with them spilled to ``--spill-dir`` (``--modes`` picks), each run in a child
process. With ``--memory-limit SIZE`` each child runs in a new memory cgroup
(v1 or v2, under this process's own) limited to SIZE, so page cache and the
process's own memory together must fit it, as on a machine with that much RAM; the
kernel then evicts the memory-mapped dataset and the spilled matrices as it needs.

Before each run the dataset's files are dropped from the page cache, so that what
the run reads is charged to its own cgroup. The table gives, per run: its exit, the
median epoch, forward and backward times, the losses (which the two modes must
share), the peak resident memory sampled every 50 ms from ``/proc`` (all of it, the
process's own "anon", the same once the epochs began, and the mapped files' "file",
which counts pages charged to the cgroup or to none) and the cgroup's peak charge
where a limit was set, against the bytes of the data: the features and graph in the
store and the (N, C) float32 matrices the propagation makes (the T output, one per
hop, the loss gradient).

    python -m fullgraph.bench.outofcore --dataset DIR --spill-dir /var/tmp/spill \\
        --memory-limit 12G --epochs 2
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fullgraph.bench import entry_point, names
from fullgraph.bench.growth import status_bytes
from fullgraph.memory import parse_bytes


def epochs(metrics: Path) -> list[dict]:
    """The epoch records of a run's ``--metrics-out`` file (none if it is missing)."""
    if not metrics.exists():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("event") == "epoch"]


def summary(records: list[dict]) -> dict[str, str]:
    """Median epoch, per-epoch forward / backward times and losses, as table cells."""
    if not records:
        return {"median": "-", "forward": "-", "backward": "-", "losses": "-"}
    return {"median": f"{statistics.median(r['epoch_s'] for r in records):.1f}",
            "forward": "/".join(f"{r['forward_s']:.1f}" for r in records),
            "backward": "/".join(f"{r['backward_s']:.1f}" for r in records),
            "losses": "/".join(f"{r['loss']:.4f}" for r in records)}


def memory_cgroup(limit: int, name: str) -> tuple[Path, str]:
    """A new memory cgroup under this process's, limited to ``limit`` bytes: its
    directory and the file a process id is written to to join it.

    Raises:
        RuntimeError: no memory controller is found or the cgroup cannot be made.
    """
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base, limit_file = Path("/sys/fs/cgroup/memory", path.lstrip("/")), \
                "memory.limit_in_bytes"
            break
    else:
        base, limit_file = Path("/sys/fs/cgroup", _v2_path().lstrip("/")), "memory.max"
    where = base / name
    try:
        where.mkdir(exist_ok=True)
        (where / limit_file).write_text(str(limit))
    except OSError as exc:
        raise RuntimeError(f"cannot make a memory cgroup at {where}: {exc}; run without "
                           f"--memory-limit, or as a user who may") from exc
    return where, "cgroup.procs"


def _v2_path() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise RuntimeError("no memory cgroup controller found (neither v1 nor v2)")


def cgroup_peak(where: Path) -> int | None:
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        try:
            return int((where / name).read_text())
        except (OSError, ValueError):
            continue
    return None


def evict(dataset: Path) -> None:
    """Drop the dataset's files from the page cache, so that a run's reads are charged
    to its own cgroup rather than found in pages another process brought in."""
    for f in dataset.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def watch(cmd: list[str], cgroup: Path | None, log: Path) -> tuple[int, dict[str, int]]:
    """Run ``cmd`` (inside ``cgroup`` if given), its output to ``log``; its exit code
    and peak VmRSS / RssAnon / RssFile in bytes, and the peak RssAnon once training
    began ("epoch_anon": setup's transients left out, such as the self-loops it adds
    to a copy of a stored graph without them)."""
    if cgroup is not None:  # join the cgroup before the training process starts
        script = f"echo $$ > {shlex.quote(str(cgroup / 'cgroup.procs'))} && exec " \
                 + " ".join(shlex.quote(c) for c in cmd)
        cmd = ["sh", "-c", script]
    peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "epoch_anon": 0}
    training = False
    with open(log, "w") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        while child.poll() is None:
            training = training or "\nepoch " in log.read_text()
            now = status_bytes(child.pid, peak)
            if training and "RssAnon" in now:
                now["epoch_anon"] = now["RssAnon"]
            for key, value in now.items():
                peak[key] = max(peak[key], value)
            time.sleep(0.05)
    return child.returncode, peak


def resolve_dataset(name: str, root: str | None) -> Path:
    """The processed folder (``meta.json`` and its arrays) of the dataset ``fullgraph
    train --dataset name --root root`` trains on: a folder ``fullgraph generate`` or
    ``convert`` made, its ``processed`` folder, or a name under the root (a built-in
    one processed there first, as ``train`` does). The bench reads its bytes, drops
    its files from the page cache and hands the children this folder, so the runs
    train on what was measured.

    Raises:
        DatasetNotFoundError: as ``fullgraph train`` for a name it does not know.
        ConfigError: a shard set (a run of one worker trains a whole dataset).
    """
    from fullgraph.config import DataConfig
    from fullgraph.errors import ConfigError
    from fullgraph.graph import datasets, store

    cfg = DataConfig(dataset=name, root=root)
    datasets.load(name, cfg.resolved_root(), verify=False)  # (the package's resolution)
    direct = Path(name).expanduser()
    # the folders `datasets.load` looks in, in its order: a path's processed/, the path,
    # the name's processed folder under the root
    places = ([direct / "processed"] if name != datasets.check_name_or_none(name) else []) + \
        [direct, datasets.processed_dir(cfg.resolved_root(), name)]
    found = next((d for d in places if (d / store.META_FILE).is_file()), None)
    if found is None:
        raise ConfigError(f"--dataset {name}: a shard set (`fullgraph partition --shards`); "
                          "give the whole dataset it was written from, whose processed "
                          f"folder holds {store.META_FILE}")
    return found


def data_bytes(dataset: Path, props: int) -> dict[str, int]:
    """Bytes of the stored features and graph, and of the (N, C) float32 matrices."""
    meta = json.loads((dataset / "meta.json").read_text())
    arrays = meta["arrays"]
    sizes = {name: (dataset / a["file"]).stat().st_size for name, a in arrays.items()}
    n = int(arrays["labels"]["shape"][0])
    classes = int(meta.get("num_classes", 0))
    return {"features": sizes.get("features", 0),
            "graph": sizes.get("indptr", 0) + sizes.get("indices", 0),
            "matrices": (props + 2) * n * classes * 4}


def gib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**30:.1f}"


@entry_point
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True, help="what `fullgraph train --dataset` takes: "
                   "a folder from `fullgraph generate` or `convert`, its processed/ folder, "
                   "or a dataset name under --root")
    p.add_argument("--root", default=None, help="the dataset root of a name (default: as "
                   "`fullgraph train`: $FULLGRAPH_DATA, else the user cache)")
    p.add_argument("--spill-dir", required=True, type=Path)
    p.add_argument("--spill-memory", default=None, help="--spill-memory of the spilled run")
    p.add_argument("--memory-limit", default=None, help="run each child in a memory cgroup "
                   "of this size, e.g. 12G")
    p.add_argument("--modes", default="memory,spill")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--props", type=int, default=2, help="propagation hops (--num-props)")
    p.add_argument("--row-block", type=int, default=65536)
    p.add_argument("--logs", type=Path, default=Path("."))
    args = p.parse_args(argv)
    limit = None if args.memory_limit is None else parse_bytes(args.memory_limit)
    modes = names(p, "--modes", args.modes, ("memory", "spill"))
    args.dataset = resolve_dataset(args.dataset, args.root)
    data = data_bytes(args.dataset, args.props)
    print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, "
          f"{os.cpu_count()} cores; dataset {args.dataset}: features {gib(data['features'])} "
          f"GiB, graph {gib(data['graph'])} GiB, (N, C) matrices {gib(data['matrices'])} GiB; "
          f"memory limit {gib(limit) + ' GiB' if limit else 'none'}")
    print("| mode | exit | median epoch s | forward s | backward s | losses | peak RSS GiB "
          "| anon | anon in epochs | file | cgroup peak |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    args.logs.mkdir(parents=True, exist_ok=True)
    for mode in modes:
        cmd = [sys.executable, "-c", "import sys; from fullgraph.cli import main; "
               "sys.exit(main())", "train", "--dataset", str(args.dataset), "--strategy",
               "tensor", "--workers", "1", "--decoupled", "--num-props", str(args.props),
               "--row-block", str(args.row_block), "--hidden", str(args.hidden),
               "--epochs", str(args.epochs)]
        if mode == "spill":
            cmd += ["--spill-dir", str(args.spill_dir)]
            if args.spill_memory:
                cmd += ["--spill-memory", args.spill_memory]
        cgroup = None if limit is None else \
            memory_cgroup(limit, f"fullgraph-{mode}-{os.getpid()}")[0]
        log = args.logs / f"outofcore-{mode}.log"
        metrics = args.logs / f"outofcore-{mode}.jsonl"
        metrics.unlink(missing_ok=True)
        evict(args.dataset)
        code, peak = watch(cmd + ["--metrics-out", str(metrics)], cgroup, log)
        cells = summary(epochs(metrics))
        cg_peak = None if cgroup is None else cgroup_peak(cgroup)
        print(f"| {mode} | {code} | {cells['median']} | {cells['forward']} | "
              f"{cells['backward']} | {cells['losses']} | {gib(peak['VmRSS'])} | "
              f"{gib(peak['RssAnon'])} | "
              f"{gib(peak['epoch_anon'])} | {gib(peak['RssFile'])} | {gib(cg_peak)} |",
              flush=True)
        if cgroup is not None:
            try:
                cgroup.rmdir()
            except OSError:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
