"""The benchmark scripts (``python -m fullgraph.bench.<name>``), and what they share.

Each script's ``main`` is wrapped in ``entry_point``: an error that is the user's to
fix (``FullgraphError``: a dataset, option or size the library refuses; a
``ValueError`` from a bad size) ends the script with one line,
``<prog>: error: <message>``, and exit status 2, as argparse ends it on a bad option
and as the ``fullgraph`` command ends on the same errors, not with a traceback after
half a table. ``FULLGRAPH_DEBUG=1`` prints the traceback too, as for the command.

The checks a script makes on its command line before any work are here too, so that
every script words them alike: comma lists of names (``names``), a CUDA device that is
not there (``require_cuda``), and the note of a script that leaves PyG out (``NO_PYG``).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar, cast

from fullgraph.errors import FullgraphError
from fullgraph.extras import EXTRAS

Main = TypeVar("Main", bound=Callable[..., int])

NO_PYG = ("PyG left out: torch_geometric is not installed; "
          f"pip install 'fullgraph[{EXTRAS['torch_geometric']}]'")
"""The note of a script that compares with PyG where it can and leaves it out here."""


def have_pyg() -> bool:
    """Whether torch_geometric imports here (else a script says ``NO_PYG``)."""
    try:
        import torch_geometric  # noqa: F401
    except ImportError:
        return False
    return True


DATASETS_ENV = "FULLGRAPH_SHARED_DATASETS"
"""The folder of the real datasets' files (``<name>/<name>.npz``, ``planetoid/raw``),
as the test suite reads it: the default ``--root`` of the scripts that read them."""


def add_root(parser: argparse.ArgumentParser, help: str) -> None:
    """``--root``: the datasets folder; by default ``$FULLGRAPH_SHARED_DATASETS``, else
    the dataset root ``fullgraph train`` reads (``$FULLGRAPH_DATA``, else the user
    cache), where the datasets it has processed are."""
    given = os.environ.get(DATASETS_ENV) or None
    if given is None:
        from fullgraph.config import DataConfig

        given = str(DataConfig().resolved_root())
    parser.add_argument("--root", default=given,
                        help=f"{help} (default: ${DATASETS_ENV}, else the dataset root "
                             f"`fullgraph train` reads; here {given})")


def entry_point(main: Main) -> Main:
    """``main`` that ends with ``<prog>: error: <message>`` and exit status 2 (raised
    as ``SystemExit``, as ``ArgumentParser.error`` does) on a ``FullgraphError`` or a
    ``ValueError``; ``<prog>`` is argparse's, so both kinds of error read alike."""
    @functools.wraps(main)
    def run(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except (FullgraphError, ValueError) as exc:
            if os.environ.get("FULLGRAPH_DEBUG"):
                traceback.print_exc()
            sys.stdout.flush()  # (the rows printed so far come before the error)
            print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None

    return cast(Main, run)


def names(parser: argparse.ArgumentParser, flag: str, value: str, allowed: Sequence[str],
          aliases: Mapping[str, str] | None = None) -> list[str]:
    """The comma list ``value`` of option ``flag``, each name one of ``allowed`` (or a
    key of ``aliases``, given as its value); an argparse error naming the choices
    otherwise."""
    aliases = aliases or {}
    items = [v for v in value.split(",") if v]
    unknown = [v for v in items if v not in allowed and v not in aliases]
    if unknown or not items:
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "no names given"
        parser.error(f"{flag}: {what}; expected some of {', '.join([*allowed, *aliases])}")
    return [aliases.get(v, v) for v in items]


def require_cuda(parser: argparse.ArgumentParser, device: str) -> None:
    """An argparse error when ``device`` is a CUDA device and none is visible (this
    torch build has no CUDA, or the host no GPU), before any work starts."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "no CUDA device is visible")
        parser.error(f"--device {device}: {why} (torch {torch.__version__}); run with "
                     "--device cpu or on a machine with a GPU")
