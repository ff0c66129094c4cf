"""PartitionBook: which part owns each vertex, and where it sits inside its part.

A vertex partition is stored as an assignment ``part_of`` (gid -> part) plus the
permutation ``perm`` that lists the gids part by part (ascending gid inside a part)
and the ``offsets`` that cut ``perm`` into parts. Part ``p`` owns the gids
``perm[offsets[p]:offsets[p + 1]]``; the local id (lid) of a vertex is its position
in that slice, so ``perm[offsets[part_of[g]] + gid_to_lid(g)] == g`` for every gid.
This is the row layout (``Shard(0)``, in DTensor's words) every placement builds on.

Empty parts are allowed (an executor must cope with a worker that owns no rows, as
it copes with uneven row counts); ``fullgraph.partition.partition`` warns when a
partitioner produced one, because it usually means ``num_parts`` is too large for
the graph. The book itself never warns: it is a data structure.

On disk a book is one ``.npz`` (no pickles) holding ``format``, ``format_version``,
``num_parts``, ``num_nodes``, ``part_of``, a SHA-256 ``checksum`` of
(``num_parts``, ``part_of``) and ``made_for``, a digest of the graph it was made for
(empty where its maker gave none; books written before it have no such field).
``save`` writes to a temporary sibling and renames it into place, so a reader never
sees half a file; ``load`` refuses a foreign, stale, truncated or modified file with a
``CacheError`` and a book for another vertex count with a ``ValidationError``, both
naming the file and the field.

The public attributes are int64 torch tensors (executors index with them); they
share memory with the numpy arrays the methods use and must be treated as read-only.
This module must not import torch.distributed or anything above the partition layer.

Shapes: N = number of vertices, P = number of parts, K = number of queried gids.
"""
from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from fullgraph.errors import CacheError, ValidationError
from fullgraph.graph.csr import Graph
from fullgraph.graph.digest import topology_digest
from fullgraph.paths import sibling_file

FORMAT_NAME = "fullgraph.PartitionBook"
FORMAT_VERSION = 1
_FIELDS = ("format", "format_version", "num_parts", "num_nodes", "part_of", "checksum")
_REBUILD_HINT = "delete the file and partition again"

IdsLike = Tensor | np.ndarray | Sequence[int] | int


def check_num_parts(num_parts: int, num_nodes: int) -> None:
    """Raise ``ValueError`` unless ``1 <= num_parts <= num_nodes``."""
    if isinstance(num_parts, bool) or not isinstance(num_parts, (int, np.integer)):
        raise TypeError(f"num_parts must be an int, got {type(num_parts).__name__}")
    if not 1 <= num_parts <= num_nodes:
        raise ValueError(f"num_parts must satisfy 1 <= num_parts <= number of vertices "
                         f"({num_nodes}), got {num_parts}; use fewer parts or a larger graph")


class PartitionBook:
    """The gid <-> (part, lid) maps of one vertex partition.

    Build it with ``from_assignment`` (or ``load``); the constructor is internal.

    Attributes:
        num_parts: P.
        part_of: (N,) int64, the part of each gid.
        perm: (N,) int64, gids ordered by part, ascending inside a part.
        offsets: (P + 1,) int64, part ``p`` is ``perm[offsets[p]:offsets[p + 1]]``.
    """

    def __init__(self, part_of: np.ndarray, num_parts: int) -> None:
        self.num_parts = int(num_parts)
        self._part_of = part_of
        sizes = np.bincount(part_of, minlength=self.num_parts)
        self._offsets = np.zeros(self.num_parts + 1, dtype=np.int64)
        np.cumsum(sizes, out=self._offsets[1:])
        self._perm = _stable_argsort(part_of, self.num_parts)
        self._lid: np.ndarray | None = None
        self._checksum: str | None = None
        self.made_for: str = ""
        """A digest of the graph the book was made for, where its maker gave one (the
        ``fullgraph partition`` command does; a caller with the graph compares it)."""
        self.part_of = torch.from_numpy(self._part_of)
        self.perm = torch.from_numpy(self._perm)
        self.offsets = torch.from_numpy(self._offsets)

    @property
    def checksum(self) -> str:
        """SHA-256 of ``num_parts`` and ``part_of``, as ``save`` records it (a loaded
        book's is the file's, verified when it was read)."""
        if self._checksum is None:
            self._checksum = _checksum(self._part_of, self.num_parts)
        return self._checksum

    # ------------------------------------------------------------ construction
    @classmethod
    def from_assignment(cls, part_of: IdsLike, num_parts: int) -> "PartitionBook":
        """A book from the part of every vertex.

        Args:
            part_of: (N,) integer part of each gid, each in ``[0, num_parts)``.
            num_parts: P >= 1; parts that receive no vertex are allowed (empty).

        Raises:
            ValidationError: ``part_of`` is not a 1-D integer array or holds an id
                outside ``[0, num_parts)`` (the message names the first bad gid).
            ValueError: ``num_parts < 1``.
        """
        if isinstance(num_parts, bool) or not isinstance(num_parts, (int, np.integer)) \
                or num_parts < 1:
            raise ValueError(f"num_parts must be an int >= 1, got {num_parts!r}")
        array = _as_numpy(part_of)
        if array.ndim != 1:
            raise ValidationError("part assignment must be 1-D", field="part_of",
                                  found=array.shape)
        if array.dtype.kind not in "iu":
            raise ValidationError("part assignment must hold integers", field="part_of",
                                  found=array.dtype)
        array = np.array(array, dtype=np.int64, order="C")  # a copy: the caller keeps theirs
        if array.size:
            bad = (array < 0) | (array >= num_parts)
            if bad.any():
                gid = int(np.argmax(bad))
                raise ValidationError("part id out of range", field=f"part_of[{gid}]",
                                      found=int(array[gid]), expected=f"0 <= part < {num_parts}")
        return cls(array, int(num_parts))

    # ------------------------------------------------------------------- maps
    @property
    def num_nodes(self) -> int:
        """N, the number of vertices."""
        return int(self._part_of.shape[0])

    def part_sizes(self) -> Tensor:
        """(P,) int64 number of vertices of each part."""
        return torch.from_numpy(np.diff(self._offsets))

    def part_to_gids(self, part: int) -> Tensor:
        """(N_p,) int64 ascending gids owned by ``part`` (a view of ``perm``)."""
        if not 0 <= int(part) < self.num_parts:
            raise ValueError(f"part must be in [0, {self.num_parts}), got {part}")
        part = int(part)
        return self.perm[int(self._offsets[part]):int(self._offsets[part + 1])]

    def gid_to_part(self, gids: IdsLike) -> Tensor:
        """(K,) int64 part of each gid (a 0-d tensor for a scalar gid)."""
        return torch.from_numpy(np.asarray(self._part_of[self._check_gids(gids)]))

    def gid_to_lid(self, gids: IdsLike) -> Tensor:
        """(K,) int64 position of each gid inside its part (a 0-d tensor for a scalar)."""
        if self._lid is None:
            lid = np.empty(self.num_nodes, dtype=np.int64)
            starts = np.repeat(self._offsets[:-1], np.diff(self._offsets))
            lid[self._perm] = np.arange(self.num_nodes, dtype=np.int64) - starts
            self._lid = lid
        return torch.from_numpy(np.asarray(self._lid[self._check_gids(gids)]))

    def _check_gids(self, gids: IdsLike) -> np.ndarray:
        array = _as_numpy(gids)
        if array.dtype.kind not in "iu":
            raise TypeError(f"gids must be integers, got dtype {array.dtype}")
        if array.size:
            lo, hi = int(array.min()), int(array.max())
            if lo < 0 or hi >= self.num_nodes:
                raise ValueError(f"gid out of range: found {lo if lo < 0 else hi}, "
                                 f"expected 0 <= gid < {self.num_nodes}")
        return array

    # ------------------------------------------------------------- comparison
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PartitionBook):
            return NotImplemented
        return (self.num_parts == other.num_parts
                and np.array_equal(self._part_of, other._part_of))

    __hash__ = None  # type: ignore[assignment]  # mutable tensors inside: not hashable

    def __repr__(self) -> str:
        sizes = np.diff(self._offsets)
        span = f"{int(sizes.min())}..{int(sizes.max())}" if sizes.size else "-"
        return (f"PartitionBook(num_nodes={self.num_nodes}, num_parts={self.num_parts}, "
                f"part_sizes={span})")

    # -------------------------------------------------------------------- disk
    def check_made_for(self, graph: Graph, path: Path | str) -> None:
        """Refuse a book whose ``made_for`` names another graph (one without it is
        taken).

        Raises:
            ValidationError: naming ``path`` and the graph's size.
        """
        if self.made_for and self.made_for != topology_digest(graph):
            raise ValidationError(f"{path} was made for another graph of {graph.num_nodes} "
                                  "vertices (its edges differ): partition this one again")

    def save(self, path: Path | str) -> None:
        """Write the book to ``path`` (one ``.npz``), replacing it atomically.

        The data go to a temporary sibling that is fsynced and then renamed over
        ``path``; the parent directory is created if needed.
        """
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = sibling_file(path, "tmp")  # 0666 less the umask, as open() gives
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, format=np.array(FORMAT_NAME),
                         format_version=np.int64(FORMAT_VERSION),
                         num_parts=np.int64(self.num_parts), num_nodes=np.int64(self.num_nodes),
                         part_of=self._part_of,
                         checksum=np.array(self.checksum), made_for=np.array(self.made_for))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path | str, num_nodes: int | None = None) -> "PartitionBook":
        """Read a book written by ``save``.

        Args:
            path: the ``.npz`` file.
            num_nodes: the vertex count the book must cover; checked when given
                (default: None, not checked).

        Raises:
            CacheError: the file is missing, not a partition book, of another format
                version, truncated, inconsistent, or fails its checksum.
            ValidationError: the book covers another number of vertices than ``num_nodes``.
        """
        path = Path(path).expanduser()
        fields = _read_fields(path)
        num_parts, part_of = _checked_fields(path, fields)
        if num_nodes is not None and part_of.shape[0] != num_nodes:
            raise ValidationError("partition book is for another graph", source=path,
                                  field="num_nodes", found=int(part_of.shape[0]),
                                  expected=int(num_nodes),
                                  hint="partition this graph again")
        book = cls(part_of, num_parts)
        book._checksum = str(fields["checksum"].item())  # verified by _checked_fields
        book.made_for = str(fields["made_for"].item()) if "made_for" in fields else ""
        return book


# ------------------------------------------------------------------- internals
def _as_numpy(ids: IdsLike) -> np.ndarray:
    if isinstance(ids, Tensor):
        return ids.detach().cpu().numpy()
    return np.asarray(ids)


def _stable_argsort(part_of: np.ndarray, num_parts: int) -> np.ndarray:
    """Gids ordered by part, ascending inside a part (a stable sort by part)."""
    # numpy's stable sort is a radix sort for <= 16-bit keys: ~10x faster than on int64.
    keys = part_of.astype(np.uint16) if num_parts <= 1 << 16 else part_of
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


def _checksum(part_of: np.ndarray, num_parts: int) -> str:
    digest = hashlib.sha256()
    digest.update(np.int64(num_parts).astype("<i8").tobytes())
    digest.update(np.ascontiguousarray(part_of, dtype="<i8").data)
    return digest.hexdigest()


def _read_fields(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise CacheError("partition book file is missing", source=path,
                         hint="partition the graph and save the book first")
    try:
        loaded = np.load(path, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):  # a single array (.npy)
            raise CacheError("not a partition book: an .npy array, not an .npz archive",
                             source=path, hint=_REBUILD_HINT)
        with loaded as npz:
            missing = [name for name in _FIELDS if name not in npz.files]
            if missing:
                raise CacheError("not a partition book: field missing", source=path,
                                 field=missing[0], hint=_REBUILD_HINT)
            return {name: npz[name] for name in (*_FIELDS, "made_for") if name in npz.files}
    except CacheError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise CacheError("partition book file is unreadable or truncated", source=path,
                         found=f"{type(exc).__name__}: {exc}", hint=_REBUILD_HINT) from None


def _checked_fields(path: Path, fields: dict[str, np.ndarray]) -> tuple[int, np.ndarray]:
    def scalar(name: str) -> Any:
        value = fields[name]
        if value.shape != ():
            raise CacheError("field must be a scalar", source=path, field=name,
                             found=value.shape, hint=_REBUILD_HINT)
        return value.item()

    if scalar("format") != FORMAT_NAME:
        raise CacheError("not a partition book", source=path, field="format",
                         found=scalar("format"), expected=FORMAT_NAME)
    if scalar("format_version") != FORMAT_VERSION:
        raise CacheError("stale partition book format version", source=path,
                         field="format_version", found=scalar("format_version"),
                         expected=FORMAT_VERSION, hint=_REBUILD_HINT)
    num_parts, num_nodes, part_of = int(scalar("num_parts")), int(scalar("num_nodes")), \
        fields["part_of"]
    if part_of.dtype != np.int64 or part_of.shape != (num_nodes,) or num_parts < 1:
        raise CacheError("part assignment does not match the header", source=path,
                         field="part_of", found=f"{part_of.dtype} {part_of.shape}",
                         expected=f"int64 ({num_nodes},), num_parts >= 1", hint=_REBUILD_HINT)
    found = _checksum(part_of, num_parts)
    if found != scalar("checksum"):
        raise CacheError("checksum mismatch (file corrupt or modified)", source=path,
                         field="checksum", found=f"sha256 {found[:16]}...",
                         expected=f"{str(scalar('checksum'))[:16]}...", hint=_REBUILD_HINT)
    if part_of.size and (int(part_of.min()) < 0 or int(part_of.max()) >= num_parts):
        raise CacheError("part id out of range", source=path, field="part_of",
                         expected=f"0 <= part < {num_parts}", hint=_REBUILD_HINT)
    return num_parts, np.ascontiguousarray(part_of)
