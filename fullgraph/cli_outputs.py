"""``fullgraph predict`` and ``fullgraph evaluate``: use a model saved by ``--save-model``.

Both run the saved model in this one process on the whole graph, whatever strategy
and worker count trained it (a saved model is in its single-process form). The
dataset defaults to the one the model was trained on and is prepared with the model's
data options (feature storage, row normalisation, split seed).
"""
from __future__ import annotations

import argparse
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
                           help="where to write the (N,) int64 predictions (.npy)")
            p.add_argument("--embeddings", nargs="?", const="", metavar="FILE",
                           help="also write the last hidden layer's (N, hidden) rows (hidden x "
                                "heads for GAT) (.npy) "
                           "to FILE (default: OUT with -embeddings before .npy)")


def _load(args: argparse.Namespace):
    from fullgraph.saved import load_dataset_for, load_model

    model = load_model(args.model)
    return model, load_dataset_for(model, args.dataset, args.root)


def cmd_predict(args: argparse.Namespace) -> int:
    import torch

    from fullgraph.paths import check_distinct, check_output

    out = Path(args.out).expanduser()
    emb_path = None if args.embeddings is None else \
        Path(args.embeddings or out.with_name(out.stem + "-embeddings.npy")).expanduser()
    check_output(args.out, "--out")
    if emb_path is not None:
        check_output(emb_path, "--embeddings")
    check_distinct([("--out", out)] + ([("--embeddings", emb_path)] if emb_path else []),
                   [("--model", args.model)])
    model, dataset = _load(args)
    with torch.no_grad():  # both computed before either is written
        logits = model(dataset.graph, dataset.data.features)
        emb = None if emb_path is None else model.embed(dataset.graph, dataset.data.features)
    _save_npy(out, logits.argmax(dim=1).numpy())
    print(f"wrote {out}: {logits.shape[0]} class predictions on {dataset.name}")
    if emb_path is not None and emb is not None:
        _save_npy(emb_path, emb.float().numpy())
        print(f"wrote {emb_path}: {emb.shape[0]} x {emb.shape[1]} embeddings")
    return 0


def _save_npy(path: Path, array: Any) -> None:
    """``array`` as an .npy file at exactly ``path`` (``np.save`` given a name adds
    ``.npy`` to one without it), its parent directories made; written beside it first
    and renamed over it, so a stopped run never leaves half a file."""
    import os

    import numpy as np

    from fullgraph.checkpoint import remove_stale_temporaries
    from fullgraph.paths import process_space, unfinished, write_in_place

    path.parent.mkdir(parents=True, exist_ok=True)
    if write_in_place(path, lambda f: np.save(f, array)):  # a pipe or a device
        return
    tmp = path.with_name(f".{path.name}.{process_space()}-{os.getpid()}.tmp")
    with unfinished(tmp):
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    remove_stale_temporaries(path)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from fullgraph.saved import accuracy

    model, dataset = _load(args)
    t = model.meta["trained"]
    print(f"model    {model.meta['model']['name']} from {args.model} (best epoch "
          f"{t['best_epoch']} of {t['epochs']}, strategy {t['strategy']} on {t['workers']} "
          f"worker(s)) on {dataset.name}")
    for split, (correct, total) in accuracy(model, dataset).items():
        acc = f"{correct / total:.2%}" if total else "n/a"
        print(f"{split:<5} accuracy {acc:>7} ({correct}/{total})")
    return 0


COMMANDS = {"predict": cmd_predict, "evaluate": cmd_evaluate}
