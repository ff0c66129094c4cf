"""Vectorised parsing of whitespace- or comma-separated numeric text tables.

Files are read in large blocks cut at line ends (gzip streams too), so memory stays
bounded by the block size plus the parsed arrays. Each block is parsed by one call of
numpy's C ``loadtxt`` (measured about twice as fast here as splitting tokens with
numpy and ``np.fromstring``, and it checks the column count itself). Nothing loops
per line in Python on the common path. When a block is malformed, or a loader finds
a bad value in row ``k``, the exact line is found afterwards: tokens per line are
counted with numpy on the raw bytes, and a bad token is found by bisecting the block.

Line numbers are 1-based and count every physical line (blank and comment lines
included), so they match what an editor shows. This module must not import anything
above the graph layer.
"""
from __future__ import annotations

import gzip
import io
import os
import re
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import numpy as np

from fullgraph.errors import DatasetNotFoundError, FormatError

BLOCK_BYTES = 32 << 20
_COMMENT = re.compile(rb"#[^\n]*")

PathLike = str | os.PathLike[str]


def open_binary(path: PathLike) -> IO[bytes]:
    """Open ``path`` for reading bytes, decompressing gzip files (by the ``.gz``
    suffix, or the gzip magic bytes at the start) on the fly.

    Raises:
        DatasetNotFoundError: the file does not exist.
    """
    path = Path(path)
    require_file(path)
    if path.suffix == ".gz" or gzip_stream(path):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def gzip_stream(path: PathLike) -> bool:
    """Whether ``path`` opens as a gzip stream: its header (magic, deflate, no reserved
    flag) and a first byte that decompresses; ids that merely begin like it do not."""
    import zlib

    with open(path, "rb") as f:
        head = f.read(4)
    if len(head) < 4 or head[:3] != b"\x1f\x8b\x08" or head[3] & 0xE0:
        return False
    try:
        with gzip.open(path, "rb") as f:
            f.read(1)
    except (OSError, EOFError, zlib.error):
        return False
    return True


def require_file(path: str | os.PathLike[str], what: str = "file") -> None:
    """Refuse a ``path`` that is not a file: missing, or a directory.

    Raises:
        DatasetNotFoundError: nothing is at ``path``.
        FormatError: ``path`` is a directory (or another kind of file).
    """
    path = Path(path)
    if path.is_file():
        return
    if path.exists():
        raise FormatError(f"{what} is a {'directory' if path.is_dir() else 'special file'}",
                          source=path, expected="a regular file")
    raise DatasetNotFoundError(f"{what} not found", source=path,
                               hint=f"place the file at {path}")


def iter_blocks(fh: IO[bytes], block_bytes: int | None = None, *,
                source: PathLike = "<stream>") -> Iterator[tuple[bytes, int]]:
    """Yield ``(block, first_line)``: chunks of whole lines and the number of the first.

    Args:
        fh: binary file object.
        block_bytes: size of a read (default: None, :data:`BLOCK_BYTES`).
        source: file name for error messages (default: ``"<stream>"``).

    Raises:
        FormatError: the (compressed) data is truncated or corrupt.
    """
    block_bytes = block_bytes or BLOCK_BYTES
    line = 1
    rest = b""
    while True:
        try:
            chunk = fh.read(block_bytes)
        except (EOFError, OSError, zlib.error) as exc:
            raise FormatError("cannot read the file: truncated or corrupt", source=source,
                              line=line, found=f"{type(exc).__name__}: {exc}") from exc
        if not chunk:
            break
        data = rest + chunk
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            rest = data
            continue
        block, rest = data[:cut], data[cut:]
        yield block, line
        line += block.count(b"\n")
    if rest:
        yield rest, line


def iter_rows(path: PathLike, *, dtype: np.dtype | type, num_cols: int | None,
              delimiter: bytes | None = None, comments: bool = False,
              expected: str | None = None, transform: Callable[[bytes], bytes] | None = None,
              block_bytes: int | None = None) -> Iterator[np.ndarray]:
    """Parse a numeric text table block by block; blank lines are skipped.

    Args:
        path: text file, optionally ``.gz`` compressed.
        dtype: numpy dtype of the parsed numbers (int64 or a float type).
        num_cols: values every non-blank line must hold; None takes the count of the
            first non-blank line.
        delimiter: column separator instead of whitespace, e.g. ``b","`` (default: None).
        comments: ignore ``#`` to the end of the line (default: False).
        expected: what a line should hold, for error messages (default: numbers).
        transform: rewrites each block before parsing, e.g. words to numeric codes; it
            must keep tokens and lines in place (default: None).
        block_bytes: size of a read (default: None, :data:`BLOCK_BYTES`, 32 MiB).

    Yields:
        (R, C) arrays, one per block that holds at least one row.

    Raises:
        FormatError: a line has the wrong number of values or a token is not a number;
            the message names the file, the line and the token.
    """
    cols = num_cols
    with open_binary(path) as fh:
        for block, first_line in iter_blocks(fh, block_bytes, source=path):
            if transform is not None:
                block = transform(block)
            values = _parse_block(block, first_line, dtype, cols, path, delimiter, comments,
                                  expected)
            if values.shape[0]:
                cols = values.shape[1]
                yield values


def read_table(path: PathLike, *, dtype: np.dtype | type, num_cols: int | None,
               delimiter: bytes | None = None, comments: bool = False,
               expected: str | None = None,
               transform: Callable[[bytes], bytes] | None = None) -> np.ndarray:
    """Parse a whole numeric text table (see :func:`iter_rows`); (0, C) when it has no rows."""
    parts = list(iter_rows(path, dtype=dtype, num_cols=num_cols, delimiter=delimiter,
                           comments=comments, expected=expected, transform=transform))
    if not parts:
        return np.zeros((0, num_cols or 0), dtype=dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def line_of_row(path: PathLike, row: int, *, delimiter: bytes | None = None,
                comments: bool = False) -> int | None:
    """1-based line number of data row ``row`` (0-based, blank lines skipped), or None."""
    seen = 0
    with open_binary(path) as fh:
        for block, first_line in iter_blocks(fh, source=path):
            nonblank = np.flatnonzero(tokens_per_line(_normalise(block, delimiter, comments)))
            if row < seen + nonblank.size:
                return first_line + int(nonblank[row - seen])
            seen += nonblank.size
    return None


def tokens_per_line(block: bytes) -> np.ndarray:
    """(L,) int64 number of whitespace-separated tokens on each line of ``block``."""
    u = np.frombuffer(block, dtype=np.uint8)
    if u.size == 0:
        return np.zeros(0, dtype=np.int64)
    ws = (u == 32) | ((u >= 9) & (u <= 13))  # C isspace(), as np.fromstring uses
    starts = ~ws
    starts[1:] &= ws[:-1]
    newlines = np.flatnonzero(u == 10)
    num_lines = newlines.size + (0 if u[-1] == 10 else 1)
    line_of_token = np.searchsorted(newlines, np.flatnonzero(starts), side="right")
    return np.bincount(line_of_token, minlength=num_lines).astype(np.int64)


# ------------------------------------------------------------------- internals
def _normalise(block: bytes, delimiter: bytes | None, comments: bool) -> bytes:
    if delimiter is not None:
        block = block.replace(delimiter, b" ")
    if comments and b"#" in block:
        block = _COMMENT.sub(b"", block)
    return block


def _parse_block(block: bytes, first_line: int, dtype: np.dtype | type, cols: int | None,
                 path: PathLike, delimiter: bytes | None, comments: bool,
                 expected: str | None) -> np.ndarray:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data"
            values = np.loadtxt(io.BytesIO(block), dtype=dtype, ndmin=2,
                                delimiter=None if delimiter is None else delimiter.decode(),
                                comments="#" if comments else None)
    except ValueError as exc:
        if delimiter is not None:
            _locate_empty_field(block, first_line, delimiter, path, expected)
        _locate_error(_normalise(block, delimiter, comments), first_line, dtype, cols, path,
                      expected)
        last = first_line + block.count(b"\n")
        raise FormatError(f"cannot parse the text of lines {first_line}-{last}", source=path,
                          found=str(exc), expected=expected) from exc
    if values.shape[0] and cols is not None and values.shape[1] != cols:
        _locate_error(_normalise(block, delimiter, comments), first_line, dtype, cols, path,
                      expected)
    return values


def _locate_empty_field(block: bytes, first_line: int, delimiter: bytes, path: PathLike,
                        expected: str | None) -> None:
    """Raise FormatError at the first empty field (``1,,2`` or a trailing delimiter)."""
    d = re.escape(delimiter)
    match = re.search(rb"(?m)" + d + rb"[ \t]*(?:" + d + rb"|\r?$)|^[ \t]*" + d, block)
    if match is not None:
        start = block.rfind(b"\n", 0, match.start()) + 1
        end = block.find(b"\n", match.start())
        text = block[start:end if end >= 0 else len(block)].rstrip(b"\r")
        raise FormatError("empty field", source=path,
                          line=first_line + block.count(b"\n", 0, match.start()),
                          found=repr(text[:80].decode("utf-8", "replace")),
                          expected=expected or "a number in every field")


def _locate_error(block: bytes, first_line: int, dtype: np.dtype | type, cols: int | None,
                  path: PathLike, expected: str | None) -> None:
    """Raise FormatError for the first bad line of ``block``; return if none is found."""
    counts = tokens_per_line(block)
    nonblank = np.flatnonzero(counts)
    if nonblank.size == 0:
        return
    cols = int(counts[nonblank[0]]) if cols is None else cols
    bad = nonblank[counts[nonblank] != cols]
    if bad.size:
        raise FormatError("wrong number of values on a line", source=path,
                          line=first_line + int(bad[0]), found=int(counts[bad[0]]),
                          expected=expected or f"{cols} values")
    lines = block.split(b"\n")
    lo, hi = 0, len(lines)
    if _parses(block, dtype, int(counts.sum())):
        return
    while hi - lo > 1:  # invariant: lines[lo:hi] holds a bad token
        mid = (lo + hi) // 2
        if _parses(b"\n".join(lines[lo:mid]), dtype, int(counts[lo:mid].sum())):
            lo = mid
        else:
            hi = mid
    kind = "an integer" if np.dtype(dtype).kind in "iu" else "a number"
    for token in lines[lo].split():
        if not _parses(token, dtype, 1):
            digits = token.lstrip(b"+-").isdigit() and np.dtype(dtype).kind in "iu"
            raise FormatError(f"{'integer too large' if digits else 'not a number'}",
                              source=path, line=first_line + lo,
                              found=repr(token.decode("utf-8", "replace")),
                              expected=expected or kind)


def _parses(text: bytes, dtype: np.dtype | type, count: int) -> bool:
    """Whether ``text`` holds ``count`` values of ``dtype``, read as the block was (an
    integer too large for the dtype fails here too; ``np.fromstring`` took it)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "input contained no data"
            return np.loadtxt(io.BytesIO(text), dtype=dtype, ndmin=1, comments=None).size \
                == count
    except ValueError:
        return False
