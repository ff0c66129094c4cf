"""Strategies own their options: sections, flags and config keys come from the registry."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest

from fullgraph.cli import build_parser, config_from_args, flag_names
from fullgraph.config import Config, config_from_dict, sections
from fullgraph.parallel import STRATEGIES, build_strategy
from fullgraph.parallel.base import section_users
from fullgraph.parallel.single import SingleProcess


class Chunky(SingleProcess):
    """A stand-in strategy whose option names collide with tensor parallelism's."""

    name = "chunky"
    section = "chunky"
    flags = {"mode": "chunky-mode"}

    @dataclass(frozen=True, kw_only=True)
    class Options:
        num_chunks: int | None = None
        mode: str = "a"


@pytest.fixture
def chunky():
    STRATEGIES["chunky"] = Chunky
    try:
        yield Chunky
    finally:
        del STRATEGIES["chunky"]


def test_a_new_strategy_brings_its_section_and_namespaced_flags(chunky):
    flags = flag_names()
    assert flags["tensor_parallel", "num_chunks"] == "num-chunks"  # the first keeps its flag
    assert flags["chunky", "num_chunks"] == "chunky-num-chunks"    # the second is namespaced
    assert flags["chunky", "mode"] == "chunky-mode"                # a declared flag
    assert sections()["chunky"] is Chunky.Options
    assert section_users()["chunky"] == ("chunky",)
    args = build_parser().parse_args(["train", "--strategy", "chunky", "--num-chunks", "3",
                                      "--chunky-num-chunks", "5", "--chunky-mode", "b"])
    cfg = config_from_args(args)
    assert cfg.options["chunky"] == Chunky.Options(num_chunks=5, mode="b")
    assert cfg.options["tensor_parallel"].num_chunks == 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = build_strategy(cfg)
    assert isinstance(strategy, Chunky) and strategy.options.num_chunks == 5
    assert any("--num-chunks has no effect" in str(w.message)
               for w in caught)


def test_config_files_take_the_declared_sections(chunky):
    cfg = config_from_dict({"runtime": {"strategy": "chunky"}, "chunky": {"num_chunks": 2}})
    assert cfg.section("chunky").num_chunks == 2 and cfg.section("runtime").strategy == "chunky"
    assert cfg.to_dict()["chunky"] == {"num_chunks": 2, "mode": "a"}
    with pytest.raises(ValueError, match="unknown key 'chunks'"):
        config_from_dict({"chunky": {"chunks": 2}})


def test_default_config_has_every_declared_section():
    cfg = Config()
    assert set(cfg.options) == {"partition", "data_parallel", "tensor_parallel", "p2p",
                                "task_parallel"}
    assert set(cfg.to_dict()) == {"data", "model", "train", "runtime", "launch", "adapt",
                                  "partition", "data_parallel", "tensor_parallel", "p2p",
                                  "task_parallel"}
