"""``fullgraph predict`` and ``fullgraph evaluate``: use a model saved by ``--save-model``.

Both run the saved model in this one process on the whole graph, whatever strategy
and worker count trained it (a saved model is in its single-process form). The
dataset defaults to the one the model was trained on and is prepared with the model's
data options (feature storage, row normalisation, split seed).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add the ``predict`` and ``evaluate`` subcommands."""
    for name, text in (("predict", "write a saved model's class predictions (and embeddings)"),
                       ("evaluate", "print a saved model's accuracy on each split")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--model", required=True, metavar="PATH",
                       help="a model file written by `train --save-model PATH`")
        p.add_argument("--dataset", help="dataset name or processed directory "
                       "(default: the one the model was trained on)")
        p.add_argument("--root", help="dataset root (default: the training run's --root "
                       "where it gave one and that directory is here, then $FULLGRAPH_DATA "
                       "or the user cache)")
        if name == "predict":
            p.add_argument("--out", required=True, metavar="FILE",
                           help="where to write the (N,) int64 class predictions; the "
                                "format follows the name: .csv (vertex,class rows with a "
                                "header), .txt (one per line), .pt (a torch tensor), else "
                                ".npy")
            p.add_argument("--scores", metavar="FILE",
                           help="also write the (N, classes) float32 class scores (logits; "
                                "a softmax of a row gives its probabilities), in the "
                                "format its own name says, as --out's")
            p.add_argument("--embeddings", nargs="?", const="", metavar="FILE",
                           help="also write the last hidden layer's (N, hidden) rows (hidden x "
                                "heads for GAT) to FILE, in the format its name says "
                                "(default: OUT with -embeddings before its suffix)")


def _load(args: argparse.Namespace):
    from fullgraph.saved import load_dataset_for, load_model

    model = load_model(args.model)
    return model, load_dataset_for(model, args.dataset, args.root)


def cmd_predict(args: argparse.Namespace) -> int:
    import torch

    from fullgraph.paths import check_distinct, check_output

    out = Path(args.out).expanduser()
    emb_path = None if args.embeddings is None else Path(
        args.embeddings or out.with_name(f"{out.stem}-embeddings{out.suffix or '.npy'}")
    ).expanduser()
    scores_path = None if args.scores is None else Path(args.scores).expanduser()
    outputs: list[tuple[str, Path]] = [
        (flag, path) for flag, path in (("--out", out), ("--scores", scores_path),
                                        ("--embeddings", emb_path)) if path is not None]
    for flag, given in (("--out", args.out), ("--scores", args.scores),
                        ("--embeddings", args.embeddings or emb_path)):
        if given:  # (as given: a trailing / names a directory)
            check_output(given, flag)
    check_distinct(outputs, [("--model", args.model)])
    model, dataset = _load(args)
    with torch.no_grad():  # all computed before any is written
        logits = model(dataset.graph, dataset.data.features)
        emb = None if emb_path is None else model.embed(dataset.graph, dataset.data.features)
    # what is said goes to stderr where an output is standard output (--out /dev/stdout)
    status = sys.stderr if any(_is_stdout(path) for _, path in outputs) else sys.stdout
    _save_rows(out, logits.argmax(dim=1).numpy(), "class")
    print(f"wrote {out}: {logits.shape[0]} class predictions on {dataset.name}", file=status)
    if scores_path is not None:
        _save_rows(scores_path, logits.float().numpy(), "class")
        print(f"wrote {scores_path}: {logits.shape[0]} x {logits.shape[1]} class scores",
              file=status)
    if emb_path is not None and emb is not None:
        _save_rows(emb_path, emb.float().numpy(), "dim")
        print(f"wrote {emb_path}: {emb.shape[0]} x {emb.shape[1]} embeddings", file=status)
    return 0


def _is_stdout(path: Path) -> bool:
    """Whether ``path`` is the file standard output writes to."""
    try:
        here, there = os.fstat(1), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _save_rows(path: Path, array: Any, column: str) -> None:
    """``array`` (one row per vertex) at exactly ``path`` in the format its suffix names
    (``.csv``: a header ``vertex,COLUMN`` or ``vertex,COLUMN_0,...`` and one row per
    vertex; ``.txt``: one row per line, spaces between values; ``.pt``: a torch tensor;
    else ``.npy``, at the name as given), its parent directories made; written beside
    it first and renamed over it, so a stopped run never leaves half a file."""
    import numpy as np

    from fullgraph.checkpoint import write_with

    suffix = path.suffix.lower()
    fmt = "%d" if array.dtype.kind in "iu" else "%.9g"  # float32 round-trips in 9 digits

    def save(f: Any) -> None:
        if suffix == ".csv":
            n = array.shape[0]
            values = array.reshape(n, -1)
            names = [column] if array.ndim == 1 else \
                [f"{column}_{j}" for j in range(values.shape[1])]
            np.savetxt(f, np.column_stack([np.arange(n), values]),
                       fmt=["%d"] + [fmt] * values.shape[1], delimiter=",",
                       header=",".join(["vertex", *names]), comments="")
        elif suffix == ".txt":
            np.savetxt(f, array, fmt=fmt)
        elif suffix == ".pt":
            import torch

            torch.save(torch.from_numpy(np.ascontiguousarray(array)), f)
        else:
            np.save(f, array)

    write_with(path, save)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from fullgraph.saved import accuracy

    model, dataset = _load(args)
    t = model.meta["trained"]  # (a mapping: load_model checked it; its keys may lack)
    print(f"model    {model.meta['model']['name']} from {args.model} (best epoch "
          f"{t.get('best_epoch', '?')} of {t.get('epochs', '?')}, strategy "
          f"{t.get('strategy', '?')} on {t.get('workers', '?')} worker(s)) on {dataset.name}")
    for split, (correct, total) in accuracy(model, dataset).items():
        acc = f"{correct / total:.2%}" if total else "n/a"
        print(f"{split:<5} accuracy {acc:>7} ({correct}/{total})")
    return 0


COMMANDS = {"predict": cmd_predict, "evaluate": cmd_evaluate}
