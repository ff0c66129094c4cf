"""Allow-list unpickler: legacy dataset pickles load, anything else is refused."""
from __future__ import annotations

import os
import pickle
import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

import fullgraph.graph
from fullgraph.errors import FormatError
from fullgraph.graph.formats.safe_pickle import load_pickle, loads_pickle

BUILTIN_CORA = Path(fullgraph.graph.__file__).resolve().parent / "builtin" / "cora"


class _RunsACommand:
    def __reduce__(self):
        return (os.system, ("echo should-never-run",))


def test_legacy_python2_pickles_load_without_deprecation_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph = load_pickle(BUILTIN_CORA / "ind.cora.graph")
        allx = load_pickle(BUILTIN_CORA / "ind.cora.allx")
        ally = load_pickle(BUILTIN_CORA / "ind.cora.ally")
    assert isinstance(graph, defaultdict) and len(graph) == 2708
    assert sp.issparse(allx) and allx.shape == (1708, 1433)
    assert isinstance(ally, np.ndarray) and ally.shape == (1708, 7)


@pytest.mark.parametrize("obj", [np.arange(6).reshape(2, 3), defaultdict(list, {1: [2, 3]}),
                                 sp.csr_matrix(np.eye(3, dtype=np.float32))])
def test_modern_pickles_of_allowed_classes(obj: object) -> None:
    out = loads_pickle(pickle.dumps(obj, protocol=4))
    assert type(out) is type(obj)
    if sp.issparse(obj):
        assert (out != obj).nnz == 0
    elif isinstance(obj, np.ndarray):
        assert np.array_equal(out, obj)
    else:
        assert out == obj


def test_code_execution_is_refused(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps(_RunsACommand(), protocol=2))
    with pytest.raises(FormatError, match="allow-list") as err:
        load_pickle(path)
    assert err.value.source == str(path)
    assert err.value.found in {"posix.system", "nt.system", "os.system"}
    assert "should-never-run" not in capfd.readouterr().out


def test_refused_class_nested_in_an_object_array() -> None:
    arr = np.empty(1, dtype=object)
    arr[0] = complex(1, 2)  # builtins.complex is not on the list
    with pytest.raises(FormatError) as err:
        loads_pickle(pickle.dumps(arr, protocol=4), source="nested")
    assert (err.value.source, err.value.found) == ("nested", "builtins.complex")


def test_corrupt_pickle() -> None:
    with pytest.raises(FormatError, match="not a readable pickle"):
        loads_pickle(pickle.dumps([1, 2, 3])[:-3], source="cut")
