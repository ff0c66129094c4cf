"""Error types shared by every layer.

A user error (bad file, bad option, unknown dataset) is raised as one of these, with a
message that names where the problem is (file, line, field), what was found and what
was expected. The CLI turns them into one line on stderr and a non-zero exit code;
anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

from typing import Any


class FullgraphError(Exception):
    """Base class of every error that is the user's to fix, not a bug."""


class DataError(FullgraphError, ValueError):
    """Bad input data: a file, array or field that does not hold what it should.

    Args:
        problem: what is wrong, in a few words.
        source: the file (or array name) the problem is in (default: None).
        line: 1-based line number inside ``source`` (default: None).
        field: the field, column or key (default: None).
        found: what was found (default: None).
        expected: what was expected instead (default: None).
        hint: how to fix it (default: None).
    """

    def __init__(self, problem: str, *, source: Any = None, line: int | None = None,
                 field: str | None = None, found: Any = None, expected: Any = None,
                 hint: str | None = None) -> None:
        self.problem = problem
        self.source = None if source is None else str(source)
        self.line = line
        self.field = field
        self.found = found
        self.expected = expected
        self.hint = hint
        super().__init__(self._format())

    def _format(self) -> str:
        where = self.source or ""
        if self.line is not None:
            where = f"{where}:{self.line}" if where else f"line {self.line}"
        parts = [f"{where}: " if where else ""]
        if self.field is not None:
            parts.append(f"{self.field}: ")
        parts.append(self.problem)
        if self.found is not None:
            parts.append(f"; found {self.found}")
        if self.expected is not None:
            parts.append(f"; expected {self.expected}")
        if self.hint:
            parts.append(f" ({self.hint})")
        return "".join(parts)


class FormatError(DataError):
    """A file cannot be parsed: wrong token, truncated record, wrong header."""


class ValidationError(DataError):
    """The data parses but is inconsistent: ids out of range, NaN features, bad masks."""


class DatasetNotFoundError(DataError):
    """A dataset name is unknown, or its files are neither on disk nor downloadable."""


class CacheError(DataError):
    """A processed cache is corrupt or stale (checksum or format version mismatch)."""


class ConfigError(FullgraphError, ValueError):
    """An option or config file value is invalid."""
