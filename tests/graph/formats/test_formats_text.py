"""Block-wise numeric text parser shared by the text formats."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from fullgraph.errors import DatasetNotFoundError, FormatError
from fullgraph.graph.formats import _text
from fullgraph.graph.formats._text import line_of_row, read_table, tokens_per_line


def _write(tmp_path: Path, text: bytes, name: str = "t.txt") -> Path:
    path = tmp_path / name
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(text))
    else:
        path.write_bytes(text)
    return path


def test_tokens_per_line() -> None:
    assert tokens_per_line(b"1 2\n\n  3\t4  5\r\n6").tolist() == [2, 0, 3, 1]
    assert tokens_per_line(b"").tolist() == []


@pytest.mark.parametrize("block_bytes", [7, 64, 1 << 20])
def test_blocks_give_the_same_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    block_bytes: int) -> None:
    monkeypatch.setattr(_text, "BLOCK_BYTES", block_bytes)
    rows = np.arange(200).reshape(100, 2)
    text = b"# c\n" + b"".join(b"%d %d\r\n" % tuple(r) for r in rows) + b"\n"
    for name in ("t.txt", "t.txt.gz"):
        path = _write(tmp_path, text, name)
        assert np.array_equal(read_table(path, dtype=np.int64, num_cols=2, comments=True), rows)
        assert line_of_row(path, 0, comments=True) == 2
        assert line_of_row(path, 99, comments=True) == 101
        assert line_of_row(path, 100, comments=True) is None


def test_error_line_across_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_text, "BLOCK_BYTES", 16)
    text = b"".join(b"%d,%d\n" % (i, i + 1) for i in range(50)).replace(b"\n33,", b"\n3e,")
    path = _write(tmp_path, text, "e.csv.gz")
    with pytest.raises(FormatError, match="not a number") as err:
        read_table(path, dtype=np.int64, num_cols=2, delimiter=b",")
    assert (err.value.source, err.value.line, err.value.found) == (str(path), 34, "'3e'")


def test_empty_field(tmp_path: Path) -> None:
    path = _write(tmp_path, b"1,2\n3,,4\n")
    with pytest.raises(FormatError, match="empty field") as err:
        read_table(path, dtype=np.float32, num_cols=None, delimiter=b",")
    assert (err.value.line, err.value.found) == (2, "'3,,4'")


def test_inferred_column_count_is_enforced(tmp_path: Path) -> None:
    path = _write(tmp_path, b"1 2 3\n4 5 6\n7 8\n")
    with pytest.raises(FormatError, match="number of values") as err:
        read_table(path, dtype=np.float64, num_cols=None)
    assert (err.value.line, err.value.found, err.value.expected) == (3, 2, "3 values")


def test_float_where_integer_expected(tmp_path: Path) -> None:
    path = _write(tmp_path, b"1 2\n3 4.5\n")
    with pytest.raises(FormatError) as err:
        read_table(path, dtype=np.int64, num_cols=2)
    assert (err.value.line, err.value.found, err.value.expected) == (2, "'4.5'", "an integer")


def test_integer_beyond_int64_names_its_line(tmp_path: Path) -> None:
    """It gave 'cannot parse the text of lines 1-4' with no line named."""
    path = _write(tmp_path, b"1 2\n3 4\n5 99999999999999999999999\n7 8\n")
    with pytest.raises(FormatError, match="integer too large") as err:
        read_table(path, dtype=np.int64, num_cols=2)
    assert (err.value.line, err.value.found) == (3, "'99999999999999999999999'")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError):
        read_table(tmp_path / "absent.txt", dtype=np.int64, num_cols=1)
