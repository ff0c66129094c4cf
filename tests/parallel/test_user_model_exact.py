"""A user's own models (``GNN`` subclasses in a file of their own, ``models/user_gnn.py``:
a transform of its own, and attention of its own) reproduce the single-process
executor under every strategy (float64), on odd and even world sizes, coupled and
decoupled: the strategies run any stage program, not only the built-in models."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cases import assert_same_run, make_dataset, run_epochs
from devices import TEST_DEVICE
from harness import run_ranks

from fullgraph.models import build_model
from fullgraph.parallel.data import DataParallel
from fullgraph.parallel.p2p import P2PParallel
from fullgraph.parallel.single import SingleProcess
from fullgraph.parallel.task import TaskParallel
from fullgraph.parallel.tensor import TensorParallel
from fullgraph.partition import PartitionOptions

pytestmark = pytest.mark.dist

USER_FILE = Path(__file__).parent.parent / "models" / "user_gnn.py"


OWN_ATTENTION = {"dot": "DotGNN", "dot-first": "AttendFirstGNN"}
"""The ``norm`` values that name a model with attention of its own."""


def make_user_model(decoupled: bool, norm: str):
    """``GatedGCN`` with propagation ``norm``, or (``norm="dot"``) ``DotGNN``, or
    (``"dot-first"``) ``AttendFirstGNN``: E T P, which p2p ran on the wrong rows."""
    torch.manual_seed(0)
    options = {} if norm in OWN_ATTENTION else {"norm": norm}
    name = f"{USER_FILE}:{OWN_ATTENTION.get(norm, 'GatedGCN')}"
    return build_model(name, 9, 5, 3, num_layers=2, dropout=0.3, decoupled=decoupled,
                       **options).to(TEST_DEVICE, torch.float64)


def strategies():
    yield "data/depcomm", DataParallel(DataParallel.Options(mode="depcomm"),
                                       PartitionOptions(method="metis"))
    yield "data/depcache", DataParallel(DataParallel.Options(mode="depcache"),
                                        PartitionOptions(method="random"))
    yield "tensor", TensorParallel()
    yield "p2p", P2PParallel(P2PParallel.Options(bin_size=5), PartitionOptions(method="g3"))
    yield "task", TaskParallel(TaskParallel.Options(subgraphs=3, chunks=6))


def check_user_model(comm, forms):
    dataset = make_dataset()
    for decoupled, norm in forms:
        ref_model = make_user_model(decoupled, norm)
        ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None)
        for label, strategy in strategies():
            model = make_user_model(decoupled, norm)
            losses, (out, gids), _ = run_epochs(strategy, dataset, model, comm)
            where = (f"user model decoupled={decoupled} norm={norm} {label} rank "
                     f"{comm.rank}/{comm.world_size}")
            assert_same_run((losses, out, gids, model), (ref_losses, ref_out, ref_model), where)


@pytest.mark.parametrize("world_size,forms", [
    (2, [(False, "gcn"), (True, "mean"), (False, "dot"), (False, "dot-first")]),
    (3, [(False, "mean"), (True, "sum"), (True, "dot"), (False, "dot-first")])])
def test_user_model_matches_single_under_every_strategy(tmp_path, world_size, forms):
    run_ranks(check_user_model, world_size, tmp_path, forms)


def check_row_sums_in_blocks(comm, _):
    """A user's stage that declares ``reduces_rows``: tensor parallelism's row blocks
    run it whole (it summed over one block, 1.6e-3 off on Cora)."""
    dataset = make_dataset()

    def model():
        torch.manual_seed(0)
        return build_model(f"{USER_FILE}:CentredGCN", 9, 5, 3, num_layers=2,
                           dropout=0.3).to(TEST_DEVICE, torch.float64)

    ref_model = model()
    ref_losses, (ref_out, _), _ = run_epochs(SingleProcess(), dataset, ref_model, None)
    strategy = TensorParallel(TensorParallel.Options(row_block=7))
    got = model()
    losses, (out, gids), _ = run_epochs(strategy, dataset, got, comm)
    assert_same_run((losses, out, gids, got), (ref_losses, ref_out, ref_model),
                    f"CentredGCN tensor row blocks rank {comm.rank}")


def test_a_stage_summing_over_all_rows_is_exact_in_row_blocks(tmp_path):
    run_ranks(check_row_sums_in_blocks, 2, tmp_path, None)
