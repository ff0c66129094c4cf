"""Vectorised parsing of whitespace- or comma-separated numeric text tables.

Files are read in large blocks cut at line ends (gzip streams too), so memory stays
bounded by the block size plus the parsed arrays. Inside a block nothing loops per
line in Python: token starts are found with numpy on the raw bytes, tokens per line
come from one ``bincount``, and the numbers from one ``np.fromstring`` call. Only when
a block is malformed do we walk its lines one by one, to report the exact line and
token. Line numbers are 1-based and count every physical line (blank and comment
lines included), so they match what an editor shows.

This module must not import anything above the graph layer.
"""
from __future__ import annotations

import gzip
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

import numpy as np

from fullgraph.errors import DatasetNotFoundError, FormatError

BLOCK_BYTES = 32 << 20
_COMMENT = re.compile(rb"#[^\n]*")


@dataclass
class Rows:
    """Rows parsed from one block of a text table.

    Attributes:
        values: (R, C) parsed numbers.
        lines: (R,) int64 1-based line number of each row in the file.
    """

    values: np.ndarray
    lines: np.ndarray


def open_binary(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open ``path`` for reading bytes, decompressing ``.gz`` files on the fly.

    Raises:
        DatasetNotFoundError: the file does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetNotFoundError("file not found", source=path,
                                   hint=f"place the file at {path}")
    if path.suffix == ".gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def iter_blocks(fh: IO[bytes], block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[bytes, int]]:
    """Yield ``(block, first_line)``: chunks of whole lines and the line number of the first."""
    line = 1
    rest = b""
    while True:
        chunk = fh.read(block_bytes)
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


def iter_rows(path: str | os.PathLike[str], *, dtype: np.dtype | type, num_cols: int | None,
              delimiter: bytes | None = None, comments: bool = False,
              block_bytes: int = BLOCK_BYTES) -> Iterator[Rows]:
    """Parse a numeric text table block by block.

    Args:
        path: text file, optionally ``.gz`` compressed.
        dtype: numpy dtype of the parsed numbers (int64 or a float type).
        num_cols: values every non-blank line must hold; None takes the count of the
            first non-blank line.
        delimiter: column separator besides whitespace, e.g. ``b","`` (default: None).
        comments: strip ``#`` to the end of the line (default: False).
        block_bytes: size of a read (default: 32 MiB).

    Yields:
        :class:`Rows` of each block that has at least one row.

    Raises:
        FormatError: a line has the wrong number of values or a token is not a number;
            the message names the file, the line and the token.
    """
    cols = num_cols
    with open_binary(path) as fh:
        for block, first_line in iter_blocks(fh, block_bytes):
            if delimiter is not None:
                block = block.replace(delimiter, b" ")
            if comments and b"#" in block:
                block = _COMMENT.sub(b"", block)
            counts = tokens_per_line(block)
            nonblank = np.flatnonzero(counts)
            if nonblank.size == 0:
                continue
            if cols is None:
                cols = int(counts[nonblank[0]])
            bad = nonblank[counts[nonblank] != cols]
            if bad.size:
                raise FormatError("wrong number of values on a line", source=path,
                                  line=first_line + int(bad[0]), found=int(counts[bad[0]]),
                                  expected=cols)
            values = _parse_numbers(block, dtype, nonblank.size * cols, path, first_line)
            yield Rows(values.reshape(nonblank.size, cols), nonblank + first_line)


def read_table(path: str | os.PathLike[str], *, dtype: np.dtype | type, num_cols: int | None,
               delimiter: bytes | None = None, comments: bool = False) -> Rows:
    """Parse a whole numeric text table (see :func:`iter_rows`); empty files give 0 rows."""
    parts = list(iter_rows(path, dtype=dtype, num_cols=num_cols, delimiter=delimiter,
                           comments=comments))
    if not parts:
        return Rows(np.zeros((0, num_cols or 0), dtype=dtype), np.zeros(0, dtype=np.int64))
    if len(parts) == 1:
        return parts[0]
    return Rows(np.concatenate([p.values for p in parts]),
                np.concatenate([p.lines for p in parts]))


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


def _parse_numbers(block: bytes, dtype: np.dtype | type, expected: int,
                   path: str | os.PathLike[str], first_line: int) -> np.ndarray:
    """All numbers of ``block`` in one call; on failure find the offending line."""
    try:
        with warnings.catch_warnings():
            # NumPy 1.x only warns (and truncates) on unparsable data.
            warnings.simplefilter("error", DeprecationWarning)
            values = np.fromstring(block, dtype=dtype, sep=" ")
    except (ValueError, DeprecationWarning):
        values = None
    if values is not None and values.size == expected:
        return values
    _raise_bad_token(block, dtype, path, first_line)
    raise FormatError("could not parse the numbers in this block", source=path,
                      line=first_line)  # pragma: no cover - _raise_bad_token raises


def _raise_bad_token(block: bytes, dtype: np.dtype | type, path: str | os.PathLike[str],
                     first_line: int) -> None:
    kind = "an integer" if np.dtype(dtype).kind in "iu" else "a number"
    for offset, line in enumerate(block.split(b"\n")):
        for token in line.split():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", DeprecationWarning)
                    ok = np.fromstring(token, dtype=dtype, sep=" ").size == 1
            except (ValueError, DeprecationWarning):
                ok = False
            if not ok:
                raise FormatError("not a number", source=path, line=first_line + offset,
                                  found=repr(token.decode("utf-8", "replace")), expected=kind)
