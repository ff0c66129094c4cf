"""An allow-list unpickler for the legacy pickles inside dataset files.

The Planetoid ``ind.*`` files and the gnn-benchmark ``.npz`` archives hold Python
pickles of scipy/numpy objects. ``pickle.load`` would run whatever callable a file
names, so every loader in this package goes through :func:`load_pickle` instead: its
``find_class`` resolves only the few classes these files need, each mapped to its
current home (``scipy.sparse.csr`` and ``numpy.core`` are deprecated module names),
and refuses everything else with a :class:`~fullgraph.errors.FormatError` naming the
file and the refused class. Nothing else is allowed: not ``_codecs.encode`` (which a
Python 3 protocol-2 pickle of bytes needs) nor numpy scalars.

This module must not import anything above the graph layer.
"""
from __future__ import annotations

import importlib
import io
import os
import pickle
from collections.abc import Callable
from typing import IO, Any

from fullgraph.errors import FormatError


def _csr_matrix() -> Any:
    from scipy.sparse import csr_matrix
    return csr_matrix


def _numpy_attr(name: str) -> Callable[[], Any]:
    def resolve() -> Any:
        import numpy
        return getattr(numpy, name)
    return resolve


def _reconstruct() -> Any:
    # NumPy 2 moved numpy.core to numpy._core; importing numpy.core there warns.
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            return importlib.import_module(module)._reconstruct
        except (ImportError, AttributeError):
            continue
    raise ImportError("numpy has no multiarray._reconstruct")  # pragma: no cover


def _defaultdict() -> Any:
    from collections import defaultdict
    return defaultdict


def _list() -> Any:
    return list


#: (module, name) as written in a pickle -> function returning the object it stands for.
ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
    ("scipy.sparse", "csr_matrix"): _csr_matrix,
    ("scipy.sparse.csr", "csr_matrix"): _csr_matrix,
    ("scipy.sparse._csr", "csr_matrix"): _csr_matrix,
    ("numpy", "ndarray"): _numpy_attr("ndarray"),
    ("numpy", "dtype"): _numpy_attr("dtype"),
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("collections", "defaultdict"): _defaultdict,
    ("builtins", "list"): _list,
    ("__builtin__", "list"): _list,
}


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the classes listed in :data:`ALLOWED`.

    Args:
        file: binary file object positioned at the start of the pickle.
        source: file name used in error messages.
        encoding: how Python 2 ``str`` objects are decoded (default: ``"latin1"``,
            which numpy needs to rebuild arrays from Python 2 pickles).
    """

    def __init__(self, file: IO[bytes], source: str | os.PathLike[str], *,
                 encoding: str = "latin1") -> None:
        super().__init__(file, encoding=encoding)
        self.source = str(source)

    def find_class(self, module: str, name: str) -> Any:
        resolve = ALLOWED.get((module, name))
        if resolve is None:
            raise FormatError("refused to unpickle a class that is not on the allow-list",
                              source=self.source, found=f"{module}.{name}",
                              expected="scipy csr_matrix, numpy ndarray/dtype/_reconstruct, "
                                       "collections.defaultdict or list",
                              hint="the file is not a plain dataset pickle; do not load "
                                   "it with pickle.load either")
        return resolve()

    def persistent_load(self, pid: Any) -> Any:
        raise FormatError("refused a persistent id in a pickle", source=self.source,
                          found=repr(pid)[:80])


def load_pickle(file: str | os.PathLike[str] | IO[bytes], *,
                source: str | os.PathLike[str] | None = None) -> Any:
    """Unpickle one object from a path or binary file with :class:`SafeUnpickler`.

    Args:
        file: path of the pickle, or an open binary file object.
        source: name used in error messages (default: the path, or ``"<pickle>"``).

    Returns:
        The unpickled object.

    Raises:
        FormatError: the pickle names a class outside the allow-list, or is corrupt
            or truncated.
    """
    if isinstance(file, (str, os.PathLike)):
        with open(file, "rb") as fh:
            return load_pickle(fh, source=source if source is not None else file)
    name = str(source) if source is not None else "<pickle>"
    try:
        return SafeUnpickler(file, name).load()
    except FormatError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, UnicodeDecodeError) as exc:
        raise FormatError("not a readable pickle", source=name,
                          found=f"{type(exc).__name__}: {exc}"[:200]) from exc


def loads_pickle(data: bytes, *, source: str | os.PathLike[str] = "<pickle>") -> Any:
    """Like :func:`load_pickle`, for a pickle held in memory."""
    return load_pickle(io.BytesIO(data), source=source)
