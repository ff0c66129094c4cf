"""``--spmm-backend auto``: the fastest candidate measured on this machine, remembered
per machine key; a slow backend is never chosen."""
from __future__ import annotations

import importlib
import json
import time

import pytest
import torch

from fullgraph.ops import select

spmm = importlib.import_module("fullgraph.ops.spmm")  # the module, not the function


def fast(graph, x):
    return x[: graph.num_dst]


def slow(graph, x):
    time.sleep(0.01)
    return x[: graph.num_dst]


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(select, "SAMPLE_VERTICES", 200)
    monkeypatch.setattr(select, "REPEATS", 3)


def test_the_slow_backend_is_never_chosen_and_the_choice_is_remembered(tmp_path, small,
                                                                        monkeypatch):
    path = tmp_path / "cache.json"
    for order in ({"slow": slow, "fast": fast}, {"fast": fast, "slow": slow}):
        path.unlink(missing_ok=True)
        choice = select.choose(order, path=path)
        assert choice.name == "fast" and choice.source == "measured"
        assert choice.seconds["slow"] > 0.009 > choice.seconds["fast"]
    assert "fast" in choice.describe() and "slow 1" in choice.describe()
    # the second time it is read back, not measured
    monkeypatch.setattr(select, "measure", lambda k: pytest.fail("measured again"))
    again = select.choose({"fast": fast, "slow": slow}, path=path)
    assert (again.name, again.source, again.where) == ("fast", "cached", str(path))
    stored = json.loads(path.read_text())
    assert len(stored) == 1 and next(iter(stored.values()))["backend"] == "fast"


def test_another_key_measures_again_and_keeps_the_other_entry(tmp_path, small, monkeypatch):
    path = tmp_path / "cache.json"
    select.choose({"fast": fast, "slow": slow}, path=path)
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 7)
    assert select.choose({"fast": fast, "slow": slow}, path=path).source == "measured"
    keys = list(json.loads(path.read_text()))
    assert len(keys) == 2 and any(f"threads {threads + 7}" in k for k in keys)
    # new kernels of fullgraph's own: measured again
    monkeypatch.setattr(select, "KERNELS_REVISION", select.KERNELS_REVISION + 1)
    assert select.choose({"fast": fast, "slow": slow}, path=path).source == "measured"
    assert len(json.loads(path.read_text())) == 3


def test_one_candidate_is_not_measured_and_a_bad_cache_is_ignored(tmp_path, small):
    assert select.choose({"torch": fast}, path=tmp_path / "x.json").source == "only candidate"
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    assert select.choose({"fast": fast, "slow": slow}, path=path).source == "measured"
    unwritable = tmp_path / "file"
    unwritable.write_text("")
    choice = select.choose({"fast": fast, "slow": slow}, path=unwritable / "cache.json")
    assert choice.name == "fast" and choice.where is None  # could not store it: still runs


def test_auto_resolves_to_the_choice_and_the_header_says_why():
    before = spmm._AUTO[0]
    try:
        spmm.set_auto(select.Choice("numba" if spmm.kernels.HAVE_NUMBA else "torch",
                                    {"torch": 0.002, "numba": 0.001}, "cached", "/x"))
        cpu = torch.device("cpu")
        assert spmm.resolve_backend(cpu) == spmm._AUTO[0].name
        assert "auto, cached: numba 1.0 ms, torch 2.0 ms" in spmm.describe_backend(cpu)
        assert spmm.resolve_backend(torch.device("meta")) == "torch"
    finally:
        spmm._AUTO[0] = before


def test_real_candidates_measure_on_the_sample(small):
    seconds = select.measure(select.candidates())
    assert set(seconds) >= {"torch"} and all(s > 0 for s in seconds.values())
