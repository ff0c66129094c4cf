"""Command-line entry point: ``fullgraph train | config | datasets | generate | convert |
partition | predict | evaluate | report | plan``.

argparse -> one frozen ``Config`` -> train. Every option of ``Config`` is exactly one
flag, generated from the dataclass fields (a test pins the list); a config file
(``--config run.yaml`` / ``.toml``) gives the same options, and flags given on the
command line override it. A user error (bad option, bad file, unknown dataset) ends
in one line on stderr and exit code 2, never in a traceback; set FULLGRAPH_DEBUG=1 (or
``--log-level debug``) to see the traceback anyway. Exit codes: 0 success, 2 usage
error, 1 (or 2 for a user error found there) when a worker failed, 130 interrupted.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import threading
import traceback
import typing
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fullgraph import __version__, cli_outputs, exactness
from fullgraph.configfile import flag_names, normalize
from fullgraph.errors import ConfigError, FullgraphError, ValidationError
from fullgraph.fields import SEED_RANGE, is_seed

if TYPE_CHECKING:
    from fullgraph.comm.group import Comm

EXIT_CODES = """\
exit codes:
  0    success
  2    usage error: a bad flag or value, config file, dataset or input file (one
       line on stderr), or a missing optional package
  1    a worker failed (the launcher names the rank and its phase first);
       fullgraph check: a strategy differs or failed, or nothing was compared
  130  interrupted (Ctrl-C)
  143  stopped by SIGTERM (129: SIGHUP); the launcher stops its workers
  141  the reader of standard output went away (`| head`): ends quietly (and
       stops the workers)
"""

CHECK_EXIT_CODES = """\
exit codes:
  0    every strategy compared is exact
  1    a strategy differs from the single process or its run failed, or every
       strategy refused the model (nothing was compared)
  2    usage error (one line on stderr)
  130  interrupted (Ctrl-C)
  141  the reader of standard output went away (`| head`): ends quietly
"""

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
  is refused with a message naming that width. Repeated edges are dropped (with
  a warning that counts them; with --symmetrize an edge may come in either
  direction or both, and none is counted).

files of `convert neutronstar` (the NeutronStar / NeutronTask four-file format):
  --edges     binary, no header: per edge src then dst, each a little-endian
              unsigned 32-bit integer (8 bytes per edge). Direction and self-loops
              are kept, repeated edges dropped; --symmetrize adds dst -> src.
  --features  text, one line per vertex: "id f1 ... fd", whitespace separated,
              d >= 1 numbers. Every id 0 .. N-1 exactly once, in any order.
  --labels    text, "id label" per line; label an integer in 0 .. C-1 (C: max
              label + 1, or --num-classes). Vertices not listed are unlabelled.
  --masks     text, "id train|val|test" per line ("eval" is read as val).
              Vertices not listed are in no split; any other word is refused.
  Errors name the file and line.
"""


def _help_line(f: dataclasses.Field, default: Any = None) -> str:
    """One line: the field's help and its default (``default`` where the command has
    its own), given once."""
    from fullgraph.fields import help_of

    text = help_of(f).replace("%", "%%")  # argparse formats help with %
    if default is not None or f.default is not None:
        return f"{text} (default: {f.default if default is None else default})"
    head, _, unset = text.partition("; unset: ")
    return f"{head} (default: {unset})" if unset else f"{text} (default: unset)"


def _add_config_flags(parser: argparse.ArgumentParser, *,
                      defaults: dict[str, Any] | None = None,
                      without: tuple[str, ...] = ()) -> None:
    """``--config`` and a flag per option of every section; ``defaults`` (``section.key``
    -> value) are the command's own, shown in the help, and ``without`` (keys) are
    options the command does not take."""
    from fullgraph.config import sections
    from fullgraph.fields import choices_of, or_else_of

    flags, defaults = flag_names(), defaults or {}
    parser.add_argument("--config", metavar="FILE", action=_Once,
                        help="YAML, TOML or JSON file of options (`fullgraph config --print` "
                        "writes one); flags given here override it")
    for section, cls in sections().items():
        group = parser.add_argument_group(f"{section} options (config section [{section}])")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = [h for h in typing.get_args(hints[f.name]) if h is not type(None)] or \
                [hints[f.name]]
            flag, dest = "--" + flags[section, f.name], f"{section}.{f.name}"
            if dest in without:
                continue
            if kind[0] is bool:
                group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                   default=None, help=_help_line(f))
                continue
            choices, more = choices_of(f), or_else_of(f)
            metavar = "{%s}" % ",".join([*choices, *more]) if choices and more else \
                None if choices else flag[2:].upper().replace("-", "_")
            group.add_argument(flag, dest=dest, type=kind[0], default=None,
                               choices=None if more else choices, metavar=metavar,
                               help=_help_line(f, defaults.get(dest)))
            if dest == "train.log_level":
                group.add_argument("-q", "--quiet", dest=dest, action="store_const",
                                   const="warning", help="print warnings and errors only "
                                   "(same as --log-level warning)")


def config_from_args(args: argparse.Namespace,
                     defaults: dict[str, dict[str, Any]] | None = None,
                     ignored: Sequence[str] = ()) -> Any:
    """Config file (if any) overlaid with the flags given on the command line, both over
    ``defaults`` (a command's own, as a config tree); the file's ``ignored`` options
    (``section.key``: those the command does not take) are dropped."""
    from fullgraph.config import config_from_dict, load_config_file, merge

    tree = load_config_file(args.config) if args.config else {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{args.config}: expected a mapping of sections and options, got "
                          f"a {type(tree).__name__}")
    tree = normalize(tree, args.config)  # the file's spellings first: then a flag wins
    for option in ignored:
        section, key = option.split(".", 1)
        if isinstance(tree.get(section), dict):
            tree[section].pop(key, None)
    in_file = {section for section, values in tree.items() if values}
    for section, values in (defaults or {}).items():  # beneath what the file gives
        given = tree.get(section, {})
        if isinstance(given, dict):
            tree[section] = {**values, **given}
    overrides: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, name = key.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    try:
        return config_from_dict(merge(tree, overrides), source=args.config or "command line")
    except ConfigError as exc:  # name where the value came from: the file, or the flags
        if not args.config:
            raise
        raise ConfigError(_named_source(str(exc), str(args.config), in_file,
                                        overrides)) from None


def _named_source(text: str, config: str, in_file: set[str],
                  overrides: dict[str, dict[str, Any]]) -> str:
    """A config error's ``text`` naming the file ``config`` where the file gave the
    option (``section.key: ...`` or ``--flag ...``), and the command line where flags
    gave the section a whole-section check refused (``FILE: section: ...``; and the
    file too where it gave that section options, ``in_file``)."""
    from fullgraph.configfile import flag_names

    if text.startswith(f"{config}: "):  # the file's name is there already
        section = re.match(r"(\w+): ", text[len(config) + 2:])
        if section is not None and overrides.get(section.group(1)):
            both = section.group(1) in in_file
            return "the command line" + (f" and {config}" if both else "") + \
                text[len(config):]
        return text
    found = re.match(r"(\w+)\.(\w+): ", text)
    where = (found.group(1), found.group(2)) if found else None
    flag = re.match(r"--([\w-]+)", text)
    if where is None and flag is not None:
        where = {f: key for key, f in flag_names().items()}.get(flag.group(1))
    if where is not None and where[1] not in overrides.get(where[0], {}):
        return f"{config}: {text}"  # the file gave it
    return text


class _Once(argparse.Action):
    """An option that may be given once: a second ``--config`` replaced the first
    without a word (its options were dropped)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} given twice ({getattr(namespace, self.dest)} and "
                         f"{values}); give one file (it may hold every option)")
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (not the whole usage), and
    which takes no abbreviated flags: ``--epoch`` is refused, not read as ``--epochs``
    (an abbreviation unique today could mean another flag when one is added)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _seed(text: str) -> int:
    """An argparse type: a seed, an integer in [0, 2**63)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not is_seed(value):
        raise argparse.ArgumentTypeError(f"expected {SEED_RANGE}, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fullgraph", description="Full-graph GNN training across many workers.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"fullgraph {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p_train = sub.add_parser("train", help="train a model on a dataset", epilog=EXIT_CODES,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_flags(p_train)

    p_config = sub.add_parser("config", help="write a config file of every option",
                              description="Print a complete config file: every option with "
                              "its value (the defaults, or the --config file and flags given), "
                              "its help and its flag. It loads back unchanged.")
    p_config.add_argument("--print", action="store_true", required=True,
                          help="print the config file on stdout")
    p_config.add_argument("--format", choices=("yaml", "toml", "json"), default="yaml",
                          help="file format (default: yaml; json has no room for the "
                          "options' help)")
    _add_config_flags(p_config)

    p_data = sub.add_parser("datasets", help="list known and processed datasets, or describe one")
    p_data.add_argument("name", nargs="?", help="a dataset to load and describe")
    p_data.add_argument("--root", help="dataset root (default: $FULLGRAPH_DATA or user cache)")

    p_gen = sub.add_parser("generate", help="write a synthetic dataset into the root")
    p_gen.add_argument("kind", choices=("rmat", "sbm"),
                       help="rmat: a power-law (R-MAT) graph with random or degree-band "
                       "labels; sbm: a stochastic block model whose edges and features carry "
                       "the class")
    p_gen.add_argument("--name", help="dataset name (default: derived from the parameters)")
    p_gen.add_argument("--root", help="dataset root (default: $FULLGRAPH_DATA or user cache)")
    p_gen.add_argument("--vertices", type=int, default=10_000,
                       help="number of vertices (default: 10000)")
    p_gen.add_argument("--edges", type=int,
                       help="rmat: edges to draw (default: 100000)")
    p_gen.add_argument("--avg-degree", type=float,
                       help="sbm: expected degree (default: 10)")
    p_gen.add_argument("--features", type=int, default=128,
                       help="feature columns (default: 128)")
    p_gen.add_argument("--classes", type=int, default=16, help="classes (default: 16)")
    p_gen.add_argument("--rmat", type=float, nargs=4, metavar=("A", "B", "C", "D"),
                       help="rmat: quadrant probabilities (default: 0.57 0.19 0.19 0.05)")
    p_gen.add_argument("--homophily", type=float,
                       help="sbm: intra-block fraction (default: 0.8)")
    p_gen.add_argument("--symmetrize", action=argparse.BooleanOptionalAction,
                       help="rmat: add the reverse of every edge (default: no; an sbm graph "
                       "is symmetric)")
    p_gen.add_argument("--seed", type=_seed, default=0, help="seed of the draws (default: 0)")
    p_gen.add_argument("--feature-dtype", choices=("float32", "float16", "bfloat16"),
                       default="float32", help="how features are stored (default: float32)")
    p_gen.add_argument("--self-loops", choices=("remove", "keep", "add"), default="remove",
                       help="drop the drawn self-loops, keep them, or give every "
                       "vertex exactly one (what GCN, GAT, GIN and decoupled models propagate "
                       "over, so their runs use the stored graph without a copy) "
                       "(default: remove)")
    p_gen.add_argument("--labels", choices=("random", "degree"),
                       help="rmat: uniform classes, or in-degree bands (default: random)")
    p_gen.add_argument("--memory", metavar="SIZE",
                       help="memory for the edges being sorted, e.g. 4G (default: a quarter "
                       "of the available memory); both generators stream to disk, so a "
                       "graph larger than memory can be written")

    p_part = sub.add_parser("partition", help="partition a dataset once and save the book; "
                            "`train --partition-file` reuses it (give --out, --shards or "
                            "--report, or several)")
    p_part.add_argument("--dataset", default="cora",
                        help="dataset name or processed directory (default: cora)")
    p_part.add_argument("--root", help="dataset root (default: $FULLGRAPH_DATA or user cache)")
    p_part.add_argument("--parts", type=int, required=True, help="number of parts (workers)")
    p_part.add_argument("--partitioner", default="metis",
                        help="chunk, random, metis or g3, or a registered name (default: "
                        "metis)")
    p_part.add_argument("--seed", type=_seed, default=0,
                        help="the partitioner's seed: random, metis, g3 (default: 0)")
    p_part.add_argument("--split-seed", type=_seed, default=0,
                        help="split of a dataset with random splits, as train's (default: 0)")
    p_part.add_argument("--out", help="where to write the partition book (.npz)")
    p_part.add_argument("--report", action="store_true",
                        help="print |V_i|, |E(V_i)|, remote vertices, edge cut, replication")
    p_part.add_argument("--shards", metavar="DIR",
                        help="also write per-part shards to DIR: each part's own feature rows "
                        "and in-edges (plus --shard-hops of replicated neighbours); train "
                        "with --dataset DIR --strategy data (or p2p, tensor, task) "
                        "--workers PARTS, each worker then reads only its part")
    p_part.add_argument("--shard-hops", type=int, default=0, metavar="H",
                        help="hops of in-neighbours each shard replicates: 0 (default) for "
                        "--dep-mode depcomm; the model's propagation hops for depcache, "
                        "hybrid or --adapt (its layers; layers x K for TAGCN; --num-props "
                        "for a decoupled model)")

    from fullgraph.graph.datasets import CONVERT_FORMATS

    p_conv = sub.add_parser("convert", help="turn your own files into a processed dataset",
                            epilog=CONVERT_EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    p_conv.add_argument("format", choices=CONVERT_FORMATS,
                        help="the input's layout: " + ", ".join(CONVERT_FORMATS))
    p_conv.add_argument("--name", required=True, help="name to train it under (--dataset NAME)")
    p_conv.add_argument("--root", help="dataset root (default: $FULLGRAPH_DATA or user cache)")
    p_conv.add_argument("--edges", help="edgelist/neutronstar: edge file")
    p_conv.add_argument("--binary", choices=("uint32", "int64"),
                        help="edgelist: binary (src, dst) records of this type, see below "
                        "(default: text)")
    p_conv.add_argument("--num-classes", type=int, metavar="N",
                        help="number of classes (default: max label + 1, refused when the "
                        "labels use far fewer distinct classes)")
    p_conv.add_argument("--features", help="features (edgelist: .npy, or a sparse matrix's "
                        "scipy.sparse.save_npz .npz, kept sparse; text for neutronstar)")
    p_conv.add_argument("--labels", help="labels (.npy for edgelist, optional there: "
                        "without them every vertex is unlabelled, data for predict; text for "
                        "neutronstar)")
    p_conv.add_argument("--masks",
                        help="masks (.npy (3, N) bool for edgelist; text for neutronstar)")
    p_conv.add_argument("--symmetrize", action=argparse.BooleanOptionalAction, default=None,
                        help="add the reverse of every edge (default: no; for ogb yes, as its "
                        "graphs are usually made undirected)")
    p_conv.add_argument("--input", help="ogb: directory in the OGB raw layout")
    p_conv.add_argument("--split-scheme", metavar="NAME",
                        help="ogb: the split/ sub-directory to read (default: the only one)")
    p_conv.add_argument("--seed", type=_seed, default=0,
                        help="split seed when no masks are given (default: 0)")
    p_conv.add_argument("--self-loops", choices=("keep", "remove", "add"), default="keep",
                        help="keep the input's self-loops, drop them, or give every vertex "
                        "exactly one (as GCN, GAT, GIN and the decoupled models but TAGCN "
                        "propagate; SAGE and TAGCN propagate without) (default: keep)")
    p_conv.add_argument("--sparse-features", choices=("auto", "on", "off"), default="auto",
                        help="store the features as CSR (their non-zeros): on, off, or auto "
                        "(on at 5%% non-zeros or fewer and 64+ columns)")
    cli_outputs.add_parsers(sub)  # predict, evaluate

    p_plan = sub.add_parser("plan", help="memory, traffic and epoch time of every strategy, "
                            "and the one to use (the options of train but the strategy, "
                            "--patience, outputs, checkpoints, resuming and the run "
                            "directory; nothing is trained)")
    _add_config_flags(p_plan, without=exactness.NOT_TAKEN)  # it prices every strategy

    p_check = sub.add_parser("check", help="train a few epochs in one process and under "
                             "each strategy, and compare the losses: is your model exact "
                             "everywhere? (the options of train but the strategy, "
                             "--patience, outputs, checkpoints, resuming and the run "
                             "directory; --strategies picks the runs)",
                             epilog=CHECK_EXIT_CODES,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_flags(p_check, defaults=exactness.DEFAULTS, without=exactness.NOT_TAKEN)
    p_check.add_argument("--strategies", default=",".join(exactness.DEFAULT_FORMS),
                         help="the runs to compare with one process, some of data "
                         f"(depcomm and depcache), {', '.join(exactness.FORMS)} (default: "
                         "%(default)s)")

    p_rep = sub.add_parser("report", help="PNG figures and an HTML summary of a run's "
                           "--metrics-out file (needs matplotlib: fullgraph[plots])")
    p_rep.add_argument("metrics", help="the JSON-lines file of `train --metrics-out`")
    p_rep.add_argument("--out", required=True, help="directory for the figures and index.html")
    return parser


CLEAN_ON_SIGNALS = ("generate", "convert", "partition", "predict", "evaluate", "report")
"""Commands that write files and run in this process: SIGTERM and SIGHUP end them as
Ctrl-C does, through the clean-up of what they were writing (temporary directories and
files), instead of leaving it behind. (``train`` and ``plan`` have the launcher's
handling, which stops the workers.)"""


class _Terminated(BaseException):
    """SIGTERM or SIGHUP arrived (``signum``); a BaseException, as KeyboardInterrupt is,
    so that no ``except Exception`` stops it on its way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stopped_by_signals(active: bool) -> Iterator[None]:
    """While active (and on the main thread), SIGTERM and SIGHUP raise ``_Terminated``
    where their default would end the process at once; signals this process ignores
    (SIGHUP under nohup) stay ignored."""
    before: dict[int, Any] = {}
    if active and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                before[sig] = signal.signal(sig, _raise_terminated)
    unraisable = sys.unraisablehook

    def again(what: Any) -> None:
        """``_Terminated`` raised in a callback from C (numba's compiler calls some)
        is swallowed there: send the signal again, from another thread a moment later
        (sent now, it would be raised in this hook, and swallowed too), to be raised
        where it unwinds."""
        if isinstance(what.exc_value, _Terminated):
            resend = threading.Timer(0.05, os.kill, (os.getpid(), what.exc_value.signum))
            resend.daemon = True
            resend.start()
        else:
            unraisable(what)

    if before:
        sys.unraisablehook = again
    try:
        yield
    finally:
        sys.unraisablehook = unraisable
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    """The ``fullgraph`` command: run ``argv`` (default: ``sys.argv[1:]``); the exit
    code."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the command started: loading torch, parsing
        from fullgraph import worker

        if os.environ.get(worker.SUPERVISED_ENV):  # the launcher says it, once
            worker.leave_now(130, flush=True)
        print("fullgraph: interrupted", file=sys.stderr)
        return 130


def _torchrun_run_dir(cfg: Any) -> None:
    """Under torchrun, ``--run-dir`` is where this host's workers keep their status,
    heartbeat and failure files (torchrun keeps the logs); ``--keep-run-dir``, which
    asks to keep the local launcher's temporary one, has no effect there."""
    from fullgraph import launch
    from fullgraph.worker import RUN_DIR_ENV

    if cfg.launch.keep_run_dir and os.environ.get("LOCAL_RANK", "0") == "0":
        warnings.warn("--keep-run-dir has no effect under torchrun (it keeps the local "
                      "launcher's temporary run directory; give --run-dir DIR for the "
                      "workers' status files)", stacklevel=2)
    if cfg.launch.run_dir:
        where = Path(cfg.launch.run_dir).expanduser()
        try:
            where.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--run-dir: cannot make {where}: {exc.strerror or exc}") from None
        rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
        for pattern in launch.RUN_FILES:  # this rank's files of an earlier run (and rank
            # 0: those of ranks beyond this run's); torchrun keeps the logs elsewhere
            (where / pattern.replace("*", rank)).unlink(missing_ok=True)
            for old in where.glob(pattern) if rank == "0" else ():
                digits = "".join(c for c in old.name if c.isdigit())
                if digits and int(digits) >= world:
                    old.unlink(missing_ok=True)
        os.environ[RUN_DIR_ENV] = str(where.resolve())


def _main(argv: list[str] | None) -> int:
    if (sys.argv[1:] if argv is None else argv) == ["--version"]:  # without loading torch
        try:
            print(f"fullgraph {__version__}", flush=True)
        except BrokenPipeError:
            return _closed_pipe_exit()
        return 0
    if argv is None:
        from fullgraph.allocator import reexec_with_allocator

        reexec_with_allocator()
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(raw)
    if extra:  # named by the (sub)command they were given to, whose --help lists its flags
        before = extra[0] in raw and raw.index(extra[0]) < raw.index(args.command)
        prog = "fullgraph" if before else f"fullgraph {args.command}"
        parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extra)} "
                    f"(see {prog} --help)\n")
    args.argv = raw
    args.debug = bool(os.environ.get("FULLGRAPH_DEBUG")) or \
        vars(args).get("train.log_level") == "debug"  # (or a config file's: below)
    formatted = args.formatwarning = warnings.formatwarning
    if not args.debug:  # a warning is one line, as an error is: no source file, no code line
        warnings.formatwarning = _one_line_warning(f"fullgraph {args.command}")
    from fullgraph import worker

    if os.environ.get(worker.SUPERVISED_ENV):
        worker.ignore_launcher_warnings()
    worker.relay_warnings()  # (a worker of a Python caller's fit or check)
    try:
        with _stopped_by_signals(args.command in CLEAN_ON_SIGNALS), worker.warnings_recorded():
            code = COMMANDS[args.command](args)
        # (launched workers whose output's reader went away: end as quietly as they did)
        return _closed_pipe_exit() if code == worker.CLOSED_PIPE_EXIT else code
    except _Terminated as exc:  # the files being written are removed; then end as signalled
        name = signal.Signals(exc.signum).name
        print(f"fullgraph {args.command}: stopped by {name}", file=sys.stderr)
        signal.signal(exc.signum, signal.SIG_DFL)
        os.kill(os.getpid(), exc.signum)
        return 128 + exc.signum  # where the signal is blocked
    except BrokenPipeError as exc:
        if worker.stdout_closed():  # the reader went away (`| head`): end quietly, as `ls` does
            return _closed_pipe_exit()
        print(f"fullgraph {args.command}: error: {_error_text(exc)}", file=sys.stderr)
        return 2
    except (FullgraphError, ValueError, OSError) as exc:
        if args.debug:
            traceback.print_exc()
        if not worker.report_start_failure(exc):  # else the launcher names it, once
            print(f"fullgraph {args.command}: error: {_as_given(_error_text(exc), args)}",
                  file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if os.environ.get(worker.SUPERVISED_ENV):  # the launcher says it, once
            worker.leave_now(130, flush=True)  # (torch's shutdown takes seconds: the
            # launcher's grace period)
        print("fullgraph: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = formatted


def _closed_pipe_exit() -> int:
    """Exit as a tool killed by SIGPIPE does, without a message: what is still buffered
    for standard output goes nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # (the interpreter's last flush goes there)
    return 128 + signal.SIGPIPE


def _as_given(text: str, args: argparse.Namespace) -> str:
    """An error's ``text`` that begins with an option's key (``launch.timeout_s: ...``)
    naming its flag instead (``--timeout: ...``) where the flag was given: the user
    typed the flag (a value from a config file keeps the key the file used)."""
    found = re.match(r"(\w+)\.(\w+): ", text)
    if found is None or vars(args).get(f"{found.group(1)}.{found.group(2)}") is None:
        return text
    flag = flag_names().get((found.group(1), found.group(2)))
    rest = text[found.end():]
    if flag is None:
        return text
    return rest if rest.startswith(f"--{flag} ") else f"--{flag}: {rest}"


def _error_text(exc: BaseException) -> str:
    """The error's message; an OS error names its file (``[Errno 21] Is a directory:
    'x'`` becomes ``x: is a directory``)."""
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, FileNotFoundError):
        where = exc.filename2 or exc.filename
        what = exc.strerror[0].lower() + exc.strerror[1:]
        return f"{where}: {what}" if where else what
    return str(exc)


def _one_line_warning(prog: str) -> Any:
    """A ``warnings.formatwarning`` that gives ``PROG: warning: MESSAGE``."""
    def fmt(message: Warning | str, category: type[Warning], filename: str, lineno: int,
            line: str | None = None) -> str:
        kind = "" if category is UserWarning else f" ({category.__name__})"
        return f"{prog}: warning{kind}: {message}\n"
    return fmt


def _config_at_log_level(args: argparse.Namespace,
                         defaults: dict[str, dict[str, Any]] | None = None,
                         ignored: Sequence[str] = ()) -> Any:
    """The run's config (``config_from_args``); at log level ``error`` no warning is
    shown, from here on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from_args(args, defaults, ignored)
    if cfg.train.log_level == "error":
        warnings.simplefilter("ignore")
    if cfg.train.log_level == "debug" and not getattr(args, "debug", True):  # a config
        args.debug = True  # file's: tracebacks and warnings' sources, as the flag's
        warnings.formatwarning = args.formatwarning
    for w in caught:  # those of the options themselves, shown or not by the level
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    from fullgraph import launch
    from fullgraph.checkpoint import check_not_replaced, resolve_resume

    cfg = resolve_resume(_config_at_log_level(args))  # (each worker too: before any writes)
    if cfg.runtime.strategy == "auto":  # resolved once, here: every worker runs the same
        if launch.under_launcher():
            raise FullgraphError("--strategy auto is resolved before the workers start; under "
                                 "torchrun run `fullgraph plan` and pass its strategy")
        from fullgraph.graph import datasets
        from fullgraph.planner import resolve_config
        from fullgraph.train import check_before_planning

        dataset = datasets.load_for(cfg.data)
        check_before_planning(cfg, dataset)
        cfg, flags, why = resolve_config(cfg, dataset)
        if cfg.train.log_level in ("debug", "info"):  # --quiet: warnings and errors only
            see = "" if dataset.shard is not None else " (`fullgraph plan` has the table)"
            print(f"strategy auto: {' '.join(flags)}: {why}{see}", file=sys.stderr)
        args.argv = [*args.argv, *flags]
    from fullgraph.train import check_outputs

    if not launch.under_launcher() or os.environ.get("RANK", "0") == "0":
        check_outputs(cfg)  # where they are written: by rank 0 alone
    else:  # (a host's own refusal, not a wait for rank 0 to its timeout; before any writes)
        check_not_replaced(cfg)
    if launch.under_launcher():
        conflict = launch.torchrun_conflict(cfg.launch.workers)
        if conflict:  # every worker refuses; one on each host says why (a host that
            # alone was given the option leaves the others waiting for it at start-up)
            if os.environ.get("LOCAL_RANK", os.environ.get("RANK")) == "0":
                print(f"fullgraph {args.command}: error: {conflict}", file=sys.stderr)
            return 2
        if launch.under_torchrun():  # (not the local launcher's workers: its run dir)
            _torchrun_run_dir(cfg)
        return launch.run_worker(lambda status: _train(cfg, status),
                                 debug=cfg.train.log_level == "debug")
    launch.check_threads(cfg.runtime.threads, cfg.launch.workers)
    if cfg.launch.workers > 1:
        from fullgraph.graph import datasets
        from fullgraph.train import check_before_launch

        launch.check_workers(cfg.launch.workers, cfg.launch.oversubscribe)
        # process the dataset once here, and find the user's errors before any worker starts
        check_before_launch(cfg, datasets.load_for(cfg.data), cfg.launch.workers)
        try:
            code = launch.launch_local(args.argv, cfg.launch.workers,
                                       timeout_s=cfg.launch.timeout_s,
                                       run_dir=cfg.launch.run_dir,
                                       threads=cfg.runtime.threads,
                                       keep_run_dir=cfg.launch.keep_run_dir)
        except BaseException:  # (interrupted: a signal the launcher sends on to itself)
            _say_where_to_resume(cfg)
            raise
        if code not in (0, 2):  # (2: a user's error, which a resumed run would repeat)
            _say_where_to_resume(cfg)
        return code
    if cfg.launch.run_dir or cfg.launch.keep_run_dir:
        warnings.warn("--run-dir and --keep-run-dir have no effect with one worker (the run "
                      "directory is the launcher's, for --workers N)", stacklevel=1)
    from fullgraph.worker import WorkerStatus

    status = WorkerStatus(0, None)  # its phase tells an option's refusal from a bug
    try:
        with _stopped_by_signals(True):  # a checkpoint or model being written is removed
            return _train(cfg, status, launched=False)
    except ValueError as exc:  # (main reports a ValueError as a user's error, exit 2)
        if status.is_user_error(exc):
            raise
        if status.phase.startswith("epoch"):
            _say_where_to_resume(cfg)
        raise RuntimeError(f"failed during {status.phase}: {type(exc).__name__}: "
                           f"{exc}") from exc
    except BaseException:
        if status.phase.startswith("epoch"):  # (not a refusal before any training)
            _say_where_to_resume(cfg)
        raise


def _say_where_to_resume(cfg: Any) -> None:
    """After a run that failed or was stopped: where its last checkpoint is, and how to
    go on from it (nothing where it wrote none)."""
    from fullgraph.checkpoint import checkpoint_file

    if cfg.train.checkpoint_dir is None:
        return
    path = checkpoint_file(cfg.train.checkpoint_dir)
    if path.is_file():
        print(f"fullgraph train: its last checkpoint is {path}; the same command with "
              "--resume auto goes on from it", file=sys.stderr)


def _load_once_per_host(cfg: Any, comm: Comm | None) -> Any:
    """Load the dataset; the first worker of each host processes it, the others wait."""
    from fullgraph.comm.primitives import barrier
    from fullgraph.graph import datasets

    if comm is None or comm.world_size == 1:
        return datasets.load_for(cfg.data)
    first = os.environ.get("LOCAL_RANK", "0") == "0"
    dataset = datasets.load_for(cfg.data, part=comm.rank) if first else None
    barrier(comm, "dataset")  # a shard set: each worker opens its own part
    return dataset if dataset is not None else datasets.load_for(cfg.data, part=comm.rank)


def _share_failures(status: Any, comm: Any) -> None:
    """Under torchrun (no local launcher watches the workers), share failures through
    the process group's store, under a key new for this run (see
    ``WorkerStatus.share_failures``). Collective."""
    import uuid

    from fullgraph import worker
    from fullgraph.comm.primitives import all_gather_object
    from fullgraph.comm.tagged import store_of

    if os.environ.get(worker.SUPERVISED_ENV) or comm.world_size < 2:
        return
    try:
        store = store_of(comm)
    except RuntimeError:  # torch's internals moved: the collectives' timeouts remain
        return
    status.share_failures(store, all_gather_object(uuid.uuid4().hex, comm, "comm-init")[0],
                          comm.timeout.total_seconds(), comm.world_size)


def _train(cfg: Any, status: Any, launched: bool = True) -> int:
    """Train in this process: alone, or as one worker of a launched job (``launched``)."""
    from fullgraph.allocator import memory_line
    from fullgraph.comm.group import check_device, destroy_comm, env_int, init_comm, resolve_device
    from fullgraph.report import Reporter
    from fullgraph.train import check_same_options, train

    check_device(cfg.train.device)
    comm = None
    if launched:
        backend = None if cfg.launch.backend == "auto" else cfg.launch.backend
        device = resolve_device(cfg.train.device, env_int("LOCAL_RANK", 0))
        comm = init_comm(backend=backend, timeout_s=cfg.launch.timeout_s, device=device)
        status.watch(comm.counter)
        _share_failures(status, comm)
    rank = comm.rank if comm is not None else 0
    try:
        if comm is not None:  # under torchrun each host has its own command line
            check_same_options(cfg, comm)
        dataset = _load_once_per_host(cfg, comm)
        reporter = Reporter(cfg.train.epochs, metrics_out=cfg.train.metrics_out,
                            progress=cfg.train.progress, enabled=rank == 0,
                            verbose=cfg.train.log_level in ("debug", "info"))
        header = [memory_line()]
        try:
            train(dataset, cfg, reporter=reporter, header=header, comm=comm, status=status,
                  local_rank=env_int("LOCAL_RANK", 0))
        finally:
            reporter.close()
    except Exception as exc:
        if comm is not None:  # before the group (and maybe its store) is torn down
            status.share_failure(exc)
        raise
    finally:
        if comm is not None:
            status.stop_watching()
            destroy_comm(comm)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from fullgraph.adapt import check_general
    from fullgraph.configfile import template

    cfg = config_from_args(args)
    check_general(cfg, cfg.launch.workers)  # (what train refuses whatever the strategy)
    if args.format == "json":
        print(json.dumps(cfg.to_dict(), indent=2))
    else:
        print(template(cfg, args.format), end="")
    return 0


def cmd_datasets(args: argparse.Namespace) -> int:
    from fullgraph.config import DataConfig
    from fullgraph.graph import datasets
    from fullgraph.graph.sparse import is_sparse

    root = DataConfig(root=args.root).resolved_root()
    if args.name:
        ds = datasets.load(args.name, root)
        if ds.shard is not None:  # (the counts below are the whole dataset's)
            print(f"{'shards':>10}: {ds.shard.parts} per-part shards with {ds.shard.hops} "
                  "hops, each worker loads its own; written from the dataset below")
        rows = list(ds.summary().items())
        x = ds.data.features
        layout = "dense" if not is_sparse(x) else \
            f"CSR, {100 * x.values().numel() / max(1, x.shape[0] * x.shape[1]):.2g}% non-zero"
        rows.append(("stored", f"{str(x.dtype).removeprefix('torch.')} features, {layout}"))
        if ds.shard is None:
            rows.append(("self-loops", ds.graph.self_loop_count()))
        counted = {key for key, _ in rows}
        rows += [(f"{key}_fraction" if key in counted and isinstance(value, float) else key,
                  value) for key, value in ds.info.items()]  # (a generator's split
        # fractions, as stored before they were named so, are not the counts above)
        width = max(len(key) for key, _ in rows)
        for key, value in rows:
            print(f"{key:>{width}}: {value}")
        return 0
    print(f"dataset root: {root}")
    for row in datasets.list_datasets(root):
        print(f"  {row['name']:<18} {row['status']:<12} {row['description']}")
    return 0


GENERATE_BYTES_PER_VERTEX = 40
"""What the generators hold per vertex beside the edge keys (``graph.synthetic``)."""
MAX_KEY_RANGES = 1024
"""The most ranges of edge sort keys ``generate --memory`` may cut the edges into: every
range draws all the edges again (``--memory 64``, bytes, made a 4 s graph take 92 s;
the time grows with the edges squared over the budget)."""


def cmd_generate(args: argparse.Namespace) -> int:
    from fullgraph.config import DataConfig
    from fullgraph.graph import datasets

    root = DataConfig(root=args.root).resolved_root()
    if args.name is not None:
        datasets.check_new_name(args.name)  # before the work of generating
    from fullgraph.memory import available_memory, parse_bytes

    free = available_memory()
    memory = (parse_bytes(args.memory) if args.memory is not None
              else max(256 << 20, (free or 4 << 30) // 4))
    _kind_options(args)
    if free and args.vertices * GENERATE_BYTES_PER_VERTEX > free:  # (a MemoryError, else)
        raise ConfigError(f"--vertices: {args.vertices} vertices need about "
                          f"{args.vertices * GENERATE_BYTES_PER_VERTEX / 2**30:.1f} GiB while "
                          f"generating ({GENERATE_BYTES_PER_VERTEX} bytes each), and "
                          f"{free / 2**30:.1f} GiB is available")
    edges = args.edges if args.kind == "rmat" else args.avg_degree * args.vertices
    if memory >= 1 and edges * 8 > MAX_KEY_RANGES * memory:  # (0: refused as out of range)
        # the edges are drawn again for every range of sort keys that fits the budget
        raise ConfigError(f"--memory: {args.memory} ({memory} bytes) holds the sort keys of "
                          f"{max(1, memory // 8)} edges, so {edges:.0f} edges would be drawn "
                          f"over {-(-edges * 8 // memory):.0f} times; give at least "
                          f"{-(-edges * 8 // MAX_KEY_RANGES):.0f} bytes (with a unit, e.g. "
                          "512M)")
    try:
        return _generate(args, root, memory)
    except ValidationError as err:  # named as its flag, not as the function's argument
        flag = GENERATE_FLAGS.get(err.field or "")
        if flag is None:
            raise
        raise ValidationError(err.problem, field=flag, found=err.found,
                              expected=err.expected, hint=err.hint) from None


GENERATE_FLAGS = {"num_nodes": "--vertices", "num_edges": "--edges",
                  "num_features": "--features", "num_classes": "--classes",
                  "avg_degree": "--avg-degree", "homophily": "--homophily",
                  "a, b, c, d": "--rmat A B C D", "seed": "--seed", "memory_bytes": "--memory"}
"""``generate``'s flags by the names ``graph.synthetic`` checks them under."""

KIND_OPTIONS: dict[str, dict[str, Any]] = {
    "rmat": {"edges": 100_000, "rmat": (0.57, 0.19, 0.19, 0.05), "symmetrize": False,
             "labels": "random"},
    "sbm": {"avg_degree": 10.0, "homophily": 0.8}}
"""The options of one generator, with their defaults (unset in the parser, so that one
given to the other generator is found)."""


def _kind_options(args: argparse.Namespace) -> None:
    """Warn about options of the other generator given to ``args.kind``; fill in the
    defaults of its own."""
    from fullgraph.configfile import flags_of

    other = next(k for k in KIND_OPTIONS if k != args.kind)
    given = [name for name in KIND_OPTIONS[other] if getattr(args, name) is not None]
    if given:
        warnings.warn(f"generate {args.kind}: {flags_of('', given)} no effect on "
                      f"{args.kind} (only on {other})", stacklevel=2)
    for name, default in KIND_OPTIONS[args.kind].items():
        if getattr(args, name) is None:
            setattr(args, name, default)


NAME_PARTS = (("features", 128, "f{}"), ("classes", 16, "c{}"), ("avg_degree", 10.0, "deg{:g}"),
              ("homophily", 0.8, "h{:g}"), ("rmat", (0.57, 0.19, 0.19, 0.05), "p{}"),
              ("symmetrize", False, "sym"), ("labels", "random", "{}"),
              ("self_loops", "remove", "loops-{}"), ("feature_dtype", "float32", "{}"),
              ("seed", 0, "seed{}"))
"""What ``generate``'s default name says of an option given another value than its
default: (option, default, how)."""


def _generated_name(args: argparse.Namespace) -> str:
    """``rmat-V-E`` or ``sbm-V-C``, then a part for each option that is not its
    default (``rmat-2000-10000-c4-sym-degree-seed7``): another draw does not silently
    replace the one written before."""
    parts = [args.kind, str(args.vertices),
             str(args.edges) if args.kind == "rmat" else str(args.classes)]
    for option, default, how in NAME_PARTS:
        value = getattr(args, option, None)
        if value is None or (option == "classes" and args.kind == "sbm"):
            continue  # (another generator's option; sbm's classes are in the name)
        if tuple(value) != default if isinstance(value, list) else value != default:
            parts.append(how.format("-".join(f"{v:g}" for v in value)
                                    if isinstance(value, list) else value))
    return "-".join(parts)


def _generate(args: argparse.Namespace, root: Any, memory: int) -> int:
    from fullgraph.graph import datasets, synthetic

    name = args.name or _generated_name(args)
    datasets.check_new_name(name)
    _check_dataset_target(root, name)
    path = datasets.processed_dir(root, name)
    replaced = _replacing(path)
    if args.kind == "rmat":
        a, b, c, d = args.rmat
        out = synthetic.write_rmat(path, args.vertices, args.edges, a=a, b=b, c=c, d=d,
                                   seed=args.seed, num_features=args.features,
                                   num_classes=args.classes, symmetrize=args.symmetrize,
                                   self_loops=args.self_loops,
                                   feature_dtype=args.feature_dtype, labels=args.labels,
                                   name=name, memory_bytes=memory)
    else:
        out = synthetic.write_sbm(path, args.vertices, args.classes,
                                  avg_degree=args.avg_degree, homophily=args.homophily,
                                  num_features=args.features, seed=args.seed,
                                  self_loops=args.self_loops,
                                  feature_dtype=args.feature_dtype, name=name,
                                  memory_bytes=memory)
    vertices, edges = out["vertices"], out["edges"]
    if args.kind == "sbm" and edges < 0.8 * args.avg_degree * vertices:
        warnings.warn(f"the mean degree is {edges / vertices:.1f}, below --avg-degree "
                      f"{args.avg_degree:g}: on {vertices} vertices in {args.classes} blocks "
                      "many draws repeat an edge, and a repeat is kept once", stacklevel=2)
    print(f"wrote {name}: {vertices} vertices, {edges} edges -> {path}{replaced}")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    import time

    from fullgraph.config import DataConfig
    from fullgraph.graph import datasets
    from fullgraph.partition import partition
    from fullgraph.partition.metrics import format_report, quality

    if not args.out and not args.report and not args.shards:
        raise ValueError("nothing to do: give --out FILE, --shards DIR or --report")
    if args.shard_hops < 0:
        raise ValueError(f"--shard-hops: must be >= 0, got {args.shard_hops}")
    if args.shard_hops and not args.shards:
        raise ValueError("--shard-hops: only with --shards DIR")
    from fullgraph.partition.shards import require_whole
    from fullgraph.paths import check_output

    if args.out:
        check_output(args.out, "--out")
    if args.shards:
        from fullgraph.partition.shards import check_target

        check_target(args.shards)  # before the work, and before --out is written

    data_cfg = DataConfig(dataset=args.dataset, root=args.root, split_seed=args.split_seed)
    dataset = datasets.load(data_cfg.dataset, data_cfg.resolved_root(),
                            split_seed=args.split_seed)
    require_whole(dataset, "partition")
    t0 = time.perf_counter()
    book = partition(dataset.graph, args.parts, args.partitioner, seed=args.seed)
    print(f"{args.partitioner} partition of {dataset.name} into {args.parts} parts in "
          f"{time.perf_counter() - t0:.2f} s")
    if args.out:
        from fullgraph.graph.digest import topology_digest

        book.made_for = topology_digest(dataset.graph)  # train refuses it for another graph
        replaced = " (replacing the file that was there)" \
            if Path(args.out).expanduser().is_file() else ""
        book.save(args.out)
        print(f"wrote {args.out}{replaced}")
    if args.shards:
        from fullgraph.checkpoint import dataset_fingerprint
        from fullgraph.partition.shards import write_shards

        t0 = time.perf_counter()
        seed = args.split_seed if datasets.split_at_load(dataset.name) else None
        replacing = _replacing(args.shards)
        given = data_cfg.dataset  # (a path made absolute: found from anywhere later)
        if datasets.check_name_or_none(given) is None:
            given = str(Path(given).expanduser().resolve())
        sizes = write_shards(dataset, book, args.shards, args.shard_hops,
                             dataset_fingerprint(dataset), args.partitioner, seed,
                             source=(given, str(data_cfg.resolved_root().resolve())))
        each = ", ".join(f"{s['vertices']}/{s['rows']}/{s['edges']}" for s in sizes)
        print(f"wrote {len(sizes)} shards with {args.shard_hops} hops to {args.shards}"
              f"{replacing} in "
              f"{time.perf_counter() - t0:.2f} s (own vertices/feature rows/edges per part: "
              f"{each}; whole graph {dataset.graph.num_nodes} vertices, "
              f"{dataset.graph.num_edges} edges)")
    if args.report:
        print(format_report(quality(dataset.graph, book)))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    import dataclasses

    from fullgraph.config import DataConfig
    from fullgraph.graph import datasets
    from fullgraph.graph.sparse import choose_layout, is_sparse

    root = DataConfig(root=args.root).resolved_root()
    _check_dataset_target(root, args.name)
    opts = datasets.ConvertOptions(
        name=args.name, edges=args.edges, features=args.features, labels=args.labels,
        masks=args.masks, input=args.input, binary=args.binary, symmetrize=args.symmetrize,
        seed=args.seed, split_scheme=args.split_scheme, num_classes=args.num_classes)
    ds = datasets.convert(args.format, opts)
    symmetrized = args.symmetrize if args.symmetrize is not None else args.format == "ogb"
    ds.info = {**ds.info, "converted with": f"--{'' if symmetrized else 'no-'}symmetrize "
               f"--self-loops {args.self_loops}"}  # what the edge count alone cannot tell
    ds.data = dataclasses.replace(ds.data, features=choose_layout(ds.data.features,
                                                                  args.sparse_features))
    if not bool(ds.data.train_mask.any()):
        warnings.warn(f"convert {args.format}: {args.name} has no training vertices "
                      "(no labels, or an empty train mask): predict and evaluate take it, "
                      "train refuses it", stacklevel=2)
    loops = ds.graph.self_loop_count()
    if args.self_loops != "keep":
        ds.graph = ds.graph.with_self_loops(args.self_loops == "add")
    noun = "self-loop" if loops == 1 else "self-loops"
    kept = f", {loops} {noun} kept" if loops and args.self_loops == "keep" else \
        f", {loops} {noun} dropped" if loops and args.self_loops == "remove" else \
        ", a self-loop on every vertex" if args.self_loops == "add" else ""
    replaced = _replacing(datasets.processed_dir(root, args.name))
    path = datasets.save_processed(ds, root, args.name)
    s = ds.summary()
    layout = " (features stored sparse)" if is_sparse(ds.data.features) else ""
    print(f"wrote {args.name}: {s['vertices']} vertices, {s['edges']} edges{kept}{layout} -> "
          f"{path}{replaced}")
    return 0


def _check_dataset_target(root: Path, name: str) -> None:
    """Before any input is read: refuse a name whose folder holds a shard set (which
    ``--dataset NAME`` would go on opening instead of what is written), and a ``--root``
    that cannot be made or written to.

    Raises:
        ConfigError: naming the folder or ``--root``.
    """
    import tempfile

    from fullgraph.graph import datasets, store

    datasets.check_name(name)
    folder = root / name
    if (folder / store.SHARDS_FILE).is_file():
        raise ConfigError(f"{folder} holds per-part shards (fullgraph partition --shards), "
                          f"which --dataset {name} would go on opening: give another name "
                          "or remove that folder")
    existing = root.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # made when the dataset is written
    try:
        if not existing.is_dir():
            raise NotADirectoryError(0, f"{existing} is not a directory")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ConfigError(f"--root {root}: cannot write there "
                          f"({exc.strerror or exc})") from None


def _replacing(path: Any) -> str:
    """`` (replacing the dataset that was there)`` where ``path`` holds one (or a shard
    set: ``... the shard set ...``), else ''."""
    from fullgraph.graph import store

    where = Path(path).expanduser()
    if (where / store.SHARDS_FILE).is_file():
        return " (replacing the shard set that was there)"
    return " (replacing the dataset that was there)" if (where / store.META_FILE).is_file() \
        else ""


def cmd_report(args: argparse.Namespace) -> int:
    from fullgraph.paths import check_output
    from fullgraph.plots import write_report

    check_output(args.out, "--out", directory=True)
    for path in write_report(args.metrics, args.out):
        print(f"wrote {path}")
    return 0


COMMANDS = {"train": cmd_train, "config": cmd_config, "datasets": cmd_datasets,
            "generate": cmd_generate, "convert": cmd_convert, "partition": cmd_partition}
COMMANDS.update(cli_outputs.COMMANDS)
COMMANDS["report"] = cmd_report


def cmd_check(args: argparse.Namespace) -> int:
    from fullgraph import launch
    if launch.under_launcher():
        raise FullgraphError("check starts its own workers: run it without torchrun")
    forms = exactness.parse_forms(args.strategies, "--strategies")
    defaults: dict[str, dict[str, Any]] = {}  # beneath the file and the flags
    for key, value in exactness.DEFAULTS.items():
        section, name = key.split(".")
        defaults.setdefault(section, {})[name] = value
    # a config file's options that check does not take are ignored, as plan's are
    cfg = _config_at_log_level(args, defaults, ignored=exactness.NOT_TAKEN)
    dataset = exactness.prepare(cfg)
    for message in exactness.unused_options(cfg, forms):
        warnings.warn(message, stacklevel=1)
    extra = f", options {cfg.model.options}" if cfg.model.options else ""
    task = exactness.task_split(cfg) if "task" in forms else None
    split = f" (task on {task[0]}, split {task[1]}, so that its T rows are split)" \
        if task and task[0] != cfg.launch.workers else \
        f" (task split {task[1]})" if task else ""
    print(f"check: model {cfg.model.name}{extra} on {cfg.data.dataset}, {cfg.train.epochs} "
          f"epoch{'' if cfg.train.epochs == 1 else 's'} from seed {cfg.train.seed}: one "
          f"process against {cfg.launch.workers} workers per strategy{split}", flush=True)
    try:
        report = exactness.run_checks(cfg, forms, dataset)
    except launch.SignalStop as stop:  # its temporary directory is gone: now end
        launch.send_on(stop, "fullgraph check")
    print(report)
    return 0 if report.exact else 1


COMMANDS["check"] = cmd_check


def cmd_plan(args: argparse.Namespace) -> int:
    from fullgraph.graph import datasets
    from fullgraph.plan_measure import rss_bytes
    from fullgraph.planner import plan_run, table_lines
    from fullgraph.train import check_before_planning

    # a config file's options that plan does not take (as flags) are ignored, as documented
    cfg, base = _config_at_log_level(args, ignored=exactness.NOT_TAKEN), rss_bytes()
    dataset = datasets.load_for(cfg.data)
    if dataset.shard is None:  # (plan injects nothing: --inject net is not refused)
        check_before_planning(cfg, dataset, launching=False)
    if dataset.shard is not None:
        print(f"fullgraph plan: {cfg.data.dataset} is per-part shards: they train on "
              f"--workers {dataset.shard.parts} (--strategy data, p2p, tensor or task), each "
              "worker holding one part; plan the dataset they were written from to compare "
              "strategies")
        return 0
    print("\n".join(table_lines(plan_run(cfg, dataset, base_rss=base))))
    return 0


COMMANDS["plan"] = cmd_plan

if __name__ == "__main__":
    sys.exit(main())
