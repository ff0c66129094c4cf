"""Command-line entry point: ``fullgraph train | datasets | generate | convert | report``.

argparse -> one frozen ``Config`` -> train. Every option of ``Config`` is exactly one
flag, generated from the dataclass fields (a test pins the list); a config file
(``--config run.yaml`` / ``.toml``) gives the same options, and flags given on the
command line override it. A user error (bad option, bad file, unknown dataset) ends
in one line on stderr and exit code 2, never in a traceback; set FULLGRAPH_DEBUG=1 to
see the traceback anyway.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import TYPE_CHECKING, Any

from fullgraph.errors import FullgraphError

if TYPE_CHECKING:
    from fullgraph.comm.group import Comm

# core section field -> flag name, where the plain ``--field`` would be unclear; the
# strategies declare theirs (``Strategy.flags``, ``parallel.base.SHARED_FLAGS``)
FLAG_NAMES = {("model", "name"): "model", ("launch", "timeout_s"): "timeout"}


CONVERT_EPILOG = """\
edge files of `convert edgelist`:
  text             one edge per line, "src dst" (whitespace separated); lines
                   starting with # and blank lines are skipped
  --binary uint32  no header; per edge src then dst, each a little-endian
                   unsigned 32-bit integer: 8 bytes per edge
  --binary int64   no header; per edge src then dst, each a little-endian
                   signed 64-bit integer: 16 bytes per edge
  Vertex ids are 0 .. N-1, N = rows of --features. A binary file that reads as
  valid pairs only at the other width (e.g. int64 pairs given as --binary uint32)
  is refused with a message naming that width.
"""


def flag_names() -> dict[tuple[str, str], str]:
    """(section, field) -> flag, for every section. A strategy's flag that another
    section already uses is namespaced with its section (``--<section>-<field>``), so
    two strategies may both have, say, ``num_chunks``; earlier sections keep theirs."""
    from fullgraph.config import sections
    from fullgraph.parallel.base import section_flags

    declared = {(sec, f): flag for sec, flags in section_flags().items() for f, flag in
                flags.items()}
    declared.update(FLAG_NAMES)
    out: dict[tuple[str, str], str] = {}
    taken: set[str] = {"config", "help"}
    for section, cls in sections().items():
        for f in dataclasses.fields(cls):
            flag = declared.get((section, f.name), f.name.replace("_", "-"))
            if flag in taken:
                flag = f"{section.replace('_', '-')}-{f.name.replace('_', '-')}"
            if flag in taken:
                raise RuntimeError(f"flag --{flag} of {section}.{f.name} is taken twice")
            taken.add(flag)
            out[section, f.name] = flag
    return out


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    from fullgraph.config import sections

    flags = flag_names()
    for section, cls in sections().items():
        group = parser.add_argument_group(f"{section} options")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = [h for h in typing.get_args(hints[f.name]) if h is not type(None)] or \
                [hints[f.name]]
            dest = f"{section}.{f.name}"
            default = f.default
            help_text = f"(default: {default})"
            if kind[0] is bool:
                group.add_argument("--" + flags[section, f.name], dest=dest,
                                   action=argparse.BooleanOptionalAction, default=None,
                                   help=help_text)
            else:
                group.add_argument("--" + flags[section, f.name], dest=dest, type=kind[0],
                                   default=None, metavar=f.name.upper(), help=help_text)


def config_from_args(args: argparse.Namespace) -> Any:
    """Config file (if any) overlaid with the flags given on the command line."""
    from fullgraph.config import config_from_dict, load_config_file, merge

    tree = load_config_file(args.config) if args.config else {}
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, name = key.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    return config_from_dict(merge(tree, overrides), source=args.config or "command line")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fullgraph", description="Full-graph GNN training across many workers.")
    sub = parser.add_subparsers(dest="command", required=True)

    p_train = sub.add_parser("train", help="train a model on a dataset",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p_train.add_argument("--config", help="YAML or TOML file with data/model/train/runtime "
                         "sections; flags override it")
    _add_config_flags(p_train)

    p_data = sub.add_parser("datasets", help="list known and processed datasets, or describe one")
    p_data.add_argument("name", nargs="?", help="a dataset to load and describe")
    p_data.add_argument("--root", help="dataset root (default: $FULLGRAPH_DATA or user cache)")

    p_gen = sub.add_parser("generate", help="write a synthetic dataset into the root")
    p_gen.add_argument("kind", choices=("rmat", "sbm"))
    p_gen.add_argument("--name", help="dataset name (default: derived from the parameters)")
    p_gen.add_argument("--root", help="dataset root (default: $FULLGRAPH_DATA or user cache)")
    p_gen.add_argument("--vertices", type=int, default=10_000)
    p_gen.add_argument("--edges", type=int, default=100_000, help="rmat: edges to draw")
    p_gen.add_argument("--avg-degree", type=float, default=10.0, help="sbm: expected degree")
    p_gen.add_argument("--features", type=int, default=128)
    p_gen.add_argument("--classes", type=int, default=16)
    p_gen.add_argument("--rmat", type=float, nargs=4, metavar=("A", "B", "C", "D"),
                       default=(0.57, 0.19, 0.19, 0.05), help="rmat: quadrant probabilities")
    p_gen.add_argument("--homophily", type=float, default=0.8, help="sbm: intra-block fraction")
    p_gen.add_argument("--symmetrize", action=argparse.BooleanOptionalAction, default=False)
    p_gen.add_argument("--seed", type=int, default=0)

    p_part = sub.add_parser("partition", help="partition a dataset once and save the book; "
                            "`train --partition-file` reuses it")
    p_part.add_argument("--dataset", default="cora", help="dataset name or processed directory")
    p_part.add_argument("--root", help="dataset root (default: $FULLGRAPH_DATA or user cache)")
    p_part.add_argument("--parts", type=int, required=True, help="number of parts (workers)")
    p_part.add_argument("--partitioner", default="metis", help="chunk, random, metis, ...")
    p_part.add_argument("--seed", type=int, default=0)
    p_part.add_argument("--out", help="where to write the partition book (.npz)")
    p_part.add_argument("--report", action="store_true",
                        help="print |V_i|, |E(V_i)|, remote vertices, edge cut, replication")

    from fullgraph.graph.datasets import CONVERT_FORMATS

    p_conv = sub.add_parser("convert", help="turn your own files into a processed dataset",
                            epilog=CONVERT_EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p_conv.add_argument("format", choices=CONVERT_FORMATS)
    p_conv.add_argument("--name", required=True, help="name to train it under (--dataset NAME)")
    p_conv.add_argument("--root", help="dataset root (default: $FULLGRAPH_DATA or user cache)")
    p_conv.add_argument("--edges", help="edgelist/neutronstar: edge file")
    p_conv.add_argument("--binary", choices=("uint32", "int64"),
                        help="edgelist: binary (src, dst) records of this type, see below "
                        "(default: text)")
    p_conv.add_argument("--num-classes", type=int, metavar="N",
                        help="number of classes (default: max label + 1, refused when the "
                        "labels use far fewer distinct classes)")
    p_conv.add_argument("--features", help="features (.npy for edgelist; text for neutronstar)")
    p_conv.add_argument("--labels", help="labels (.npy for edgelist; text for neutronstar)")
    p_conv.add_argument("--masks",
                        help="masks (.npy (3, N) bool for edgelist; text for neutronstar)")
    p_conv.add_argument("--symmetrize", action=argparse.BooleanOptionalAction, default=False)
    p_conv.add_argument("--input", help="ogb: directory in the OGB raw layout")
    p_conv.add_argument("--seed", type=int, default=0, help="split seed when no masks are given")

    p_rep = sub.add_parser("report", help="PNG figures and an HTML summary of a run's "
                           "--metrics-out file (needs matplotlib: fullgraph[plots])")
    p_rep.add_argument("metrics", help="the JSON-lines file of `train --metrics-out`")
    p_rep.add_argument("--out", required=True, help="directory for the figures and index.html")
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        from fullgraph.allocator import reexec_with_allocator

        reexec_with_allocator()
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    args.argv = raw
    try:
        return COMMANDS[args.command](args)
    except (FullgraphError, ValueError, FileNotFoundError) as exc:
        if os.environ.get("FULLGRAPH_DEBUG"):
            raise
        print(f"fullgraph {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fullgraph: interrupted", file=sys.stderr)
        return 130


def cmd_train(args: argparse.Namespace) -> int:
    from fullgraph import launch

    cfg = config_from_args(args)
    if launch.under_launcher():
        conflict = launch.torchrun_conflict(cfg.launch.workers)
        if conflict:  # every worker refuses; one says why
            if os.environ.get("RANK") == "0":
                print(f"fullgraph {args.command}: error: {conflict}", file=sys.stderr)
            return 2
        return launch.run_worker(lambda status: _train(cfg, status))
    if cfg.launch.workers > 1:
        from fullgraph.graph import datasets
        from fullgraph.train import check_before_launch

        launch.check_workers(cfg.launch.workers, cfg.launch.oversubscribe)
        # process the dataset once here, and find the user's errors before any worker starts
        check_before_launch(cfg, datasets.load_for(cfg.data), cfg.launch.workers)
        return launch.launch_local(args.argv, cfg.launch.workers, timeout_s=cfg.launch.timeout_s,
                                   run_dir=cfg.launch.run_dir, threads=cfg.runtime.threads,
                                   keep_run_dir=cfg.launch.keep_run_dir)
    return _train(cfg, None)


def _load_once_per_host(cfg: Any, comm: Comm | None) -> Any:
    """Load the dataset; the first worker of each host processes it, the others wait."""
    from fullgraph.comm.primitives import barrier
    from fullgraph.graph import datasets

    if comm is None or comm.world_size == 1:
        return datasets.load_for(cfg.data)
    first = os.environ.get("LOCAL_RANK", "0") == "0"
    dataset = datasets.load_for(cfg.data) if first else None
    barrier(comm, "dataset")
    return dataset if dataset is not None else datasets.load_for(cfg.data)


def _train(cfg: Any, status: Any) -> int:
    """Train in this process: alone, or as one worker of a launched job."""
    from fullgraph.allocator import active_allocator, transparent_hugepages
    from fullgraph.comm.group import destroy_comm, init_comm
    from fullgraph.report import Reporter
    from fullgraph.train import check_device, train

    check_device(cfg.train.device)
    comm = None
    if status is not None:
        backend = None if cfg.launch.backend == "auto" else cfg.launch.backend
        device = "cuda" if cfg.train.device.startswith("cuda") else "cpu"
        comm = init_comm(backend=backend, timeout_s=cfg.launch.timeout_s, device=device)
        status.watch(comm.counter)
    rank = comm.rank if comm is not None else 0
    try:
        dataset = _load_once_per_host(cfg, comm)
        reporter = Reporter(cfg.train.epochs, metrics_out=cfg.train.metrics_out,
                            progress=cfg.train.progress, enabled=rank == 0)
        header = [f"memory   allocator {active_allocator()}, transparent huge pages "
                  f"{transparent_hugepages()}"]
        try:
            train(dataset, cfg, reporter=reporter, header=header, comm=comm, status=status,
                  local_rank=int(os.environ.get("LOCAL_RANK", "0")))
        finally:
            reporter.close()
    finally:
        if comm is not None:
            destroy_comm(comm)
    return 0


def cmd_datasets(args: argparse.Namespace) -> int:
    from fullgraph.config import DataConfig
    from fullgraph.graph import datasets

    root = DataConfig(root=args.root).resolved_root()
    if args.name:
        ds = datasets.load(args.name, root)
        for key, value in ds.summary().items():
            print(f"{key:>10}: {value}")
        for key, value in ds.info.items():
            print(f"{key:>10}: {value}")
        return 0
    print(f"dataset root: {root}")
    for row in datasets.list_datasets(root):
        print(f"  {row['name']:<18} {row['status']:<12} {row['description']}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from fullgraph.config import DataConfig
    from fullgraph.graph import datasets, synthetic

    root = DataConfig(root=args.root).resolved_root()
    if args.name is not None:
        datasets.check_name(args.name)  # before the work of generating
    if args.kind == "rmat":
        a, b, c, d = args.rmat
        ds = synthetic.rmat(args.vertices, args.edges, a=a, b=b, c=c, d=d, seed=args.seed,
                            num_features=args.features, num_classes=args.classes,
                            symmetrize=args.symmetrize)
    else:
        ds = synthetic.sbm(args.vertices, args.classes, avg_degree=args.avg_degree,
                           homophily=args.homophily, num_features=args.features, seed=args.seed)
    name = args.name or ds.name
    path = datasets.save_processed(ds, root, name)
    s = ds.summary()
    print(f"wrote {name}: {s['vertices']} vertices, {s['edges']} edges -> {path}")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    import time

    from fullgraph.config import DataConfig
    from fullgraph.graph import datasets
    from fullgraph.partition import partition
    from fullgraph.partition.metrics import format_report, quality

    if not args.out and not args.report:
        raise ValueError("nothing to do: give --out FILE, --report, or both")
    data_cfg = DataConfig(dataset=args.dataset, root=args.root)
    dataset = datasets.load(data_cfg.dataset, data_cfg.resolved_root())
    t0 = time.perf_counter()
    book = partition(dataset.graph, args.parts, args.partitioner, seed=args.seed)
    print(f"{args.partitioner} partition of {dataset.name} into {args.parts} parts in "
          f"{time.perf_counter() - t0:.2f} s")
    if args.out:
        book.save(args.out)
        print(f"wrote {args.out}")
    if args.report:
        print(format_report(quality(dataset.graph, book)))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from fullgraph.config import DataConfig
    from fullgraph.graph import datasets

    root = DataConfig(root=args.root).resolved_root()
    opts = datasets.ConvertOptions(
        name=args.name, edges=args.edges, features=args.features, labels=args.labels,
        masks=args.masks, input=args.input, binary=args.binary, symmetrize=args.symmetrize,
        seed=args.seed, num_classes=args.num_classes)
    ds = datasets.convert(args.format, opts)
    path = datasets.save_processed(ds, root, args.name)
    s = ds.summary()
    print(f"wrote {args.name}: {s['vertices']} vertices, {s['edges']} edges -> {path}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from fullgraph.plots import write_report

    for path in write_report(args.metrics, args.out):
        print(f"wrote {path}")
    return 0


COMMANDS = {"train": cmd_train, "datasets": cmd_datasets, "generate": cmd_generate,
            "convert": cmd_convert, "partition": cmd_partition}
COMMANDS["report"] = cmd_report

if __name__ == "__main__":
    sys.exit(main())
